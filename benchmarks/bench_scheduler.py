"""The scheduler's host cost per step: `schedule()` + `update()` with the KV cache manager, no
model and no JAX (a fake token per sequence), prefix caching on.

One request arrives first and computes its prompt; the others arrive next and share the first
`--shared` tokens of its prompt from the prefix cache. Then every sequence decodes, one token a
step, for the rest of `--steps` steps: each step plans every sequence, reserves a page where a
sequence crosses a page boundary, and caches each page once full.

    python benchmarks/bench_scheduler.py --seqs 64 --steps 2000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxinfer.core.scheduler import Scheduler  # noqa: E402
from jaxinfer.kv import KVCacheManager  # noqa: E402
from jaxinfer.sampling.params import SamplingParams  # noqa: E402


def run(seqs: int, steps: int, prompt: int, shared: int, page_size: int) -> tuple[float, float]:
    """Seconds for `steps` steps, and the prefix cache's hit rate."""
    kv_cache = KVCacheManager(seqs * -(-(prompt + steps + 1) // page_size) + 1, page_size)
    sched = Scheduler(
        kv_cache, max_num_batched_tokens=seqs * prompt, max_num_seqs=seqs, max_model_len=prompt + steps + 1
    )
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0)
    start = time.perf_counter()
    for step in range(steps):
        for i in range(1) if step == 0 else range(1, seqs) if step == 1 else ():
            sched.add_request(str(i), list(range(shared)) + [1000 + i] * (prompt - shared), params)
        plan = sched.schedule()
        sched.update(plan, [(step * 7 + e.seq.seq_id) % 997 + 1 for e in plan.seqs])
    seconds = time.perf_counter() - start
    if sched.num_running != seqs:
        raise RuntimeError(f"{sched.num_running} of {seqs} sequences still running")
    return seconds, kv_cache.prefix_cache_hit_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--prompt", type=int, default=48, help="prompt tokens per request")
    parser.add_argument("--shared", type=int, default=32, help="leading prompt tokens all requests share")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    runs = [run(args.seqs, args.steps, args.prompt, args.shared, args.page_size) for _ in range(args.repeats)]
    per_step = [seconds / args.steps * 1e6 for seconds, _ in runs]
    print(
        f"{args.seqs} sequences, {args.steps} steps: median {statistics.median(per_step):.1f} us per step "
        f"(min {min(per_step):.1f}, runs {', '.join(f'{t:.1f}' for t in per_step)}); "
        f"prefix cache hit rate {runs[0][1]:.3f}"
    )


if __name__ == "__main__":
    main()
