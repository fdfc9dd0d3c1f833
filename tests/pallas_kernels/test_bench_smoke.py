"""benchmarks/bench_attention.py --smoke: every code path (ceilings, correctness check, timing,
jax's paged_attention, the table) on tiny shapes with the kernels interpreted."""

import importlib.util
import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax

DEFAULT_WARN_BYTES = jax.config.jax_captured_constants_warn_bytes
BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_attention.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_attention", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    return bench


def test_bench_attention_smoke(capsys):
    """Decode rows and the mixed batch (the prefill scenario runs in the sweep's smoke); with
    --profile, a second table names each row (off an accelerator: no device kernels)."""
    with warnings.catch_warnings():  # a captured cache (not threaded through the timed loop)
        # would be embedded in the executable: 1 GB at b=256 on a GPU, and 2 GB of profile
        warnings.filterwarnings("error", message="A large amount of constants")
        jax.config.update("jax_captured_constants_warn_bytes", 128 * 1024)  # smoke caches: >= 180 KB
        try:
            load_bench().main(["--smoke", "--profile", "--scenarios", "decode,mixed"])
        finally:
            jax.config.update("jax_captured_constants_warn_bytes", DEFAULT_WARN_BYTES)
    table, profile = capsys.readouterr().out.split("\n| scenario | impl | device kernel |")
    rows = [line for line in table.splitlines() if line.startswith("| ")][1:]  # past the header
    impls = {row.split("|")[2].strip() for row in rows}
    # The mixed batch takes the decode split; "one call" is the kernel without it.
    assert {"pallas_gpu", "pallas_gpu one call", "reference (XLA)"} <= impls
    assert len(rows) >= 8
    for row in rows:
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert cells[2], f"no time: {row}"
        assert "FAIL" not in row and not cells[-1], row
    profiled = profile.splitlines()[2:]
    assert [r.split("|")[1:3] for r in profiled] == [r.split("|")[1:3] for r in rows], profile
    if jax.default_backend() == "cpu":
        assert all("no device kernels" in row for row in profiled)


def test_bench_attention_tpu_smoke(capsys):
    """--kernel tpu: the TPU kernel as it ships (decode / mixed / prefill paths) and as one
    ragged call, checked against the reference and timed; jax's TPU kernel gets its row (it
    asks for a TPU version, so off a TPU the row reports that instead of a time)."""
    # The mixed scenario alone: its decodes and its chunk take two of the paths.
    load_bench().main(["--smoke", "--kernel", "tpu", "--scenarios", "mixed"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]  # past the header
    impls = [row.split("|")[2].strip() for row in rows]
    assert impls == ["pallas_tpu", "pallas_tpu one call", "reference (XLA)", "jax ops.tpu.ragged_paged_attention"]
    for row in rows:
        cells = [c.strip() for c in row.split("|")[1:-1]]
        if cells[1].startswith("jax ") and jax.default_backend() != "tpu":
            assert "TPU version" in cells[-1], row
            continue
        assert cells[2] and "FAIL" not in row and not cells[-1], row


def test_bench_attention_sweep_smoke(capsys):
    """--sweep: the default config's neighbours (the first two, in a smoke run) each run,
    check and time; under the decode split they vary the call of the non-decode sequences."""
    load_bench().main(["--smoke", "--sweep", "--scenarios", "prefill", "--skip-reference"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    swept = [row for row in rows if "bkv=" in row]
    assert len(swept) == 2 and all("pallas_gpu rest bq=" in row for row in swept)
    for row in swept:
        assert "FAIL" not in row and not row.split("|")[-2].strip(), row


def test_decode_sweep_has_a_ladder_of_kv_splits():
    bench = load_bench()
    model = bench.Model(32, 8, 128, 16, "bfloat16")
    batch = bench.Batch(
        "decode",
        "",
        (jax.ShapeDtypeStruct((64, 32, 128), "bfloat16"),)
        + (None,) * 4
        + (jax.ShapeDtypeStruct((64, 64), "int32"),)
        + (None,) * 2,
        None,
        None,
        0,
        0,
        True,
    )
    configs = bench.sweep_configs(batch, model)
    assert {(c.num_splits, c.num_warps) for c in configs} >= {(s, w) for s in (2, 4, 8, 16) for w in (4, 8)}
    assert {c.num_splits for c in configs if c.num_stages == 2} >= {4, 8}  # pipelined gathers
    assert len(configs) == len(set(configs))


def test_gpu_session_script_rejects_an_unknown_part(tmp_path):
    script = BENCH.parent / "gpu_session.sh"
    for parts in (["nope"], ["check:10", "nope"], ["check:ten"]):
        done = subprocess.run(
            ["bash", str(script), *parts],
            capture_output=True,
            text=True,
            cwd=BENCH.parents[1],
            env={**os.environ, "OUTDIR": str(tmp_path)},
        )
        assert done.returncode == 2 and f"unknown part: {parts[-1]}" in done.stderr, done.stderr
        assert not (tmp_path / "gpu_check.txt").exists()  # refused before anything ran
