"""What running a batch job through Ray Data costs: one bare engine against the same job through
`jaxinfer.integrations.ray` with 1 and 2 replicas, side by side in one run, on the same cores.

    python benchmarks/bench_ray.py                          # SmolLM2 (embedded), 96 rows, 32 tokens each
    python benchmarks/bench_ray.py --rows 192 --max-tokens 64 --rounds 3 --cpus 2

The rows are chat questions (greedy, ignore_eos, --max-tokens each). Per way, medians over
--rounds of:
  first_s, last_s   job start to the first / last row back (Ray Data starts a dataset's actors
                    when it runs, so for Ray these hold the replicas' start-up; the bare engine
                    is built and warmed before its clock starts)
  rows/s, tok/s     over [first row, last row]: the steady stream once rows flow
  startup_s         for Ray: a one-row job through the same processor (actors started, LLM loaded
                    and compiled from the persistent compilation cache, one row back)
and per replica tok/s (tok/s / replicas) against a bare engine on the cores one replica gets
(--cpus / replicas): the Ray overhead on the same cores. The bare engine is `jaxinfer batch`'s
loop (cli/batch.run_batch), in this process on every core, and in a child process pinned to one
core (sched_setaffinity before JAX starts) for the replicas that share two cores.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from testpaths import SMOLLM2_SMALL  # noqa: E402

from jaxinfer.cli.batch import run_batch  # noqa: E402
from jaxinfer.sampling.params import SamplingParams  # noqa: E402

QUESTIONS = [
    "Give me three tips for sleeping better.",
    "Explain photosynthesis to a ten-year-old.",
    "Write a short email asking my manager for a day off next Friday.",
    "What is the capital of France? Answer in one sentence.",
    "List five uses of a paperclip.",
    "Why is the sky blue?",
]


def rows(n: int, max_tokens: int) -> list[dict]:
    return [
        {"id": f"r{i}", "messages": [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"}],
         "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        for i in range(n)
    ]  # fmt: skip


class _Clock(io.StringIO):
    """run_batch's output, with the time each line was written."""

    def __init__(self):
        super().__init__()
        self.times: list[float] = []

    def write(self, s: str) -> int:
        self.times.append(time.monotonic())
        return super().write(s)


def bare(requests: list[dict]) -> dict:
    from jaxinfer.llm import LLM

    llm = LLM(**SMOLLM2_SMALL)
    lines = [json.dumps(r) for r in requests]
    run_batch(llm, lines[:4], io.StringIO(), SamplingParams())  # warm: every variant the job meets
    out, start = _Clock(), time.monotonic()
    run_batch(llm, lines, out, SamplingParams())
    tokens = sum(len(json.loads(line)["outputs"][0]["token_ids"]) for line in out.getvalue().splitlines())
    return _rates(start, out.times, tokens)


def bare_on(cores: int, requests: list[dict]) -> dict:
    """bare() in a child process that runs on the first `cores` CPUs only (set before JAX starts:
    XLA's CPU thread pool follows the affinity), as one replica of `cores` cores would."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(
        1, initializer=os.sched_setaffinity, initargs=(0, range(cores))
    ) as pool:
        return pool.apply(bare, (requests,))


def _rates(start: float, times: list[float], tokens: int) -> dict:
    span = max(times[-1] - times[0], 1e-9)
    return {
        "first_s": times[0] - start,
        "last_s": times[-1] - start,
        "rows/s": (len(times) - 1) / span,
        "tok/s": tokens * (len(times) - 1) / len(times) / span,
    }


def through_ray(requests: list[dict], replicas: int, cpus: int) -> dict:
    import ray.data

    from jaxinfer.integrations.ray import JaxinferProcessorConfig, build_processor

    config = JaxinferProcessorConfig(
        None, SMOLLM2_SMALL, concurrency=replicas, batch_size=8, num_cpus=cpus / replicas, max_concurrent_batches=8
    )
    nest = lambda row: {  # noqa: E731
        **row,
        "sampling_params": {k: row.pop(k) for k in ("max_tokens", "ignore_eos", "temperature")},
    }
    processor = build_processor(config, preprocess=nest)
    start = time.monotonic()
    next(iter(processor(ray.data.from_items(requests[:1])).iter_rows()))
    startup = time.monotonic() - start
    times, tokens = [], 0
    start = time.monotonic()
    dataset = processor(ray.data.from_items(requests, override_num_blocks=8 * replicas))
    for row in dataset.iter_rows():
        times.append(time.monotonic())
        tokens += row["num_generated_tokens"]
    return {"startup_s": startup, **_rates(start, times, tokens)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--cpus", type=int, default=2, help="the Ray cluster's CPUs, shared by the replicas")
    args = p.parse_args()
    import ray

    requests = rows(args.rows, args.max_tokens)
    results: dict[str, list[dict]] = {"bare": [], "bare 1 core": [], "ray x1": [], "ray x2": []}
    for _ in range(args.rounds):
        results["bare"].append(bare(requests))
        results["bare 1 core"].append(bare_on(1, requests))
    ray.init(num_cpus=args.cpus, log_to_driver=False, include_dashboard=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    for _ in range(args.rounds):
        results["ray x1"].append(through_ray(requests, 1, args.cpus))
        results["ray x2"].append(through_ray(requests, 2, args.cpus))
    base = statistics.median(r["tok/s"] for r in results["bare"])
    one_core = statistics.median(r["tok/s"] for r in results["bare 1 core"])
    print(f"{args.rows} rows x {args.max_tokens} tokens, SmolLM2 {SMOLLM2_SMALL}, {args.rounds} round(s)")
    print(f"{'way':12} {'startup_s':>9} {'first_s':>8} {'last_s':>7} {'rows/s':>7} {'tok/s':>7} {'per replica':>12}")
    for way, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        replicas = int(way[-1]) if way.startswith("ray") else 1
        per = med["tok/s"] / replicas
        same_cores = base if replicas == 1 and way != "bare 1 core" else one_core  # a bare engine on its cores
        print(
            f"{way:12} {med.get('startup_s', 0):9.1f} {med['first_s']:8.2f} {med['last_s']:7.2f} "
            f"{med['rows/s']:7.2f} {med['tok/s']:7.1f} {per:7.1f} ({per / same_cores:.2f}x of bare on its cores)"
        )


if __name__ == "__main__":
    main()
