"""A mixture of experts beside the dense model with the same active parameters, in one run:

    .venv/bin/python benchmarks/bench_moe.py [--dense smollm2 --moe smollm2-moe] [--batches 1 8] [--layers N]
        [--quantization int8|int4 [--group-size N]]

Both are random-weight shapes from benchmarks/shapes.py (`smollm2-moe` is SmolLM2 with 8 experts
of half its MLP width, top 2: the same active MLP width). Each runs in an Engine of the same
settings, one after the other, each in a fresh process: median steady-state decode step time per batch
(greedy, random prompts) and the time to first token of one prompt. Prints a markdown table with
the MoE / dense step-time ratio; the issue's goal is a ratio <= 1.5. `--quantization` quantizes
both models' linear weights, the experts included (as `LLM(quantization=...)` would).
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import run_engine_decode, run_engine_prefill  # noqa: E402
from shapes import SHAPES, active_param_count, random_model  # noqa: E402

from jaxinfer.config import EngineConfig  # noqa: E402
from jaxinfer.engine import Engine  # noqa: E402
from jaxinfer.quant.inspect import param_count  # noqa: E402


def measure(shape: str, args) -> dict:
    model = random_model(
        shape, args.dtype, quantization=args.quantization, group_size=args.group_size, num_layers=args.layers
    )
    jax.block_until_ready(model.params)
    sizes = {"params": param_count(model.params), "active": active_param_count(model)}
    # The buckets the measured steps run in: each decode batch exactly, and the budget for the
    # prompts (a batch's prompts are padded to it; their steps are not timed). The powers of two
    # between would only lengthen the warm-up.
    budget = max(args.prefill_len, 64, *args.batches)
    config = EngineConfig(
        max_num_seqs=max(args.batches),
        max_num_batched_tokens=budget,
        token_buckets=tuple(sorted({*args.batches, budget})),
        max_model_len=2048,
        penalties=False,
        compilation_cache_dir=args.cache_dir,
    )
    engine = Engine(model, config)
    variants = engine.worker.num_compiled()
    out = {"decode": {}, **sizes}
    for b in args.batches:
        out["decode"][b] = statistics.median(
            run_engine_decode(engine, b, args.prompt_len, args.new_tokens, seed) for seed in range(args.repeats)
        )
        print(
            f"[{time.strftime('%H:%M:%S')}] {shape} decode batch {b}: {1e3 * out['decode'][b]:.2f} ms per step",
            file=sys.stderr,
            flush=True,
        )
    out["prefill"] = statistics.median(
        run_engine_prefill(engine, args.prefill_len, seed) for seed in range(args.repeats)
    )
    assert engine.worker.num_compiled() == variants, "a step compiled after warm-up"
    out["dtype"] = str(model.params.embed.dtype)
    del engine, model
    gc.collect()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dense", default="smollm2", choices=sorted(SHAPES))
    ap.add_argument("--moe", default="smollm2-moe", choices=sorted(SHAPES))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prefill-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 on accelerators, float32 on the CPU")
    ap.add_argument("--layers", type=int, default=None, help="only the first layers of both shapes (quick runs)")
    ap.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int4"],
        help="weight-only quantization of both models (experts included)",
    )
    ap.add_argument("--group-size", type=int, default=64, help="int4 group size")
    ap.add_argument("--cache-dir", default="auto", help="compilation cache: a directory, none, or auto (as jaxinfer)")
    args = ap.parse_args()
    if not SHAPES[args.moe].num_experts:
        ap.error(f"--moe {args.moe}: that shape has no experts")
    # Each shape in a fresh process: an engine measured after another in the same process ran
    # 1.1-1.4x slower, whichever model it held (benchmarks/RESULTS.md, out-first weights).
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), max_tasks_per_child=1) as pool:
        dense = pool.submit(measure, args.dense, args).result()
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), max_tasks_per_child=1) as pool:
        moe = pool.submit(measure, args.moe, args).result()
    weights = f", weights {args.quantization}" if args.quantization else ""
    print(
        f"Device: {jax.devices()[0].device_kind} x {jax.device_count()} ({jax.default_backend()}); "
        f"jax {jax.__version__}; {dense['dtype']}{weights}; decode after a {args.prompt_len}-token prompt, "
        f"medians of {args.repeats}"
    )
    print(
        f"Parameters: {args.dense} {dense['params'] / 1e6:.1f}M (all active); {args.moe} "
        f"{moe['params'] / 1e6:.1f}M, {moe['active'] / 1e6:.1f}M active per token\n"
    )
    print(f"| run | {args.dense} (ms) | {args.moe} (ms) | MoE / dense |\n|---|---|---|---|")
    rows = [(f"decode step, batch {b}", dense["decode"][b], moe["decode"][b]) for b in args.batches]
    rows.append((f"prefill, one {args.prefill_len}-token prompt", dense["prefill"], moe["prefill"]))
    for name, d, m in rows:
        print(f"| {name} | {1e3 * d:.2f} | {1e3 * m:.2f} | {m / d:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
