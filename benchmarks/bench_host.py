"""The host's share of a decode window: `InputBuilder.prepare` on a decode-only plan, and the
bytes of the step inputs it hands the device, at batch 256 with long contexts (no model, no
device: the builder alone).

Each sequence decodes one token a window of `--window` steps, as the engine's decode windows
do; a page is appended when a sequence crosses a page boundary (pages reserved for the whole
window first). The plan's page tuples are built as the scheduler builds them, timed apart.

    python benchmarks/bench_host.py --batch 256 --contexts 1024 8192 --windows 40
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxinfer.config import EngineConfig  # noqa: E402
from jaxinfer.core.plan import ScheduledSeq, SchedulerPlan  # noqa: E402
from jaxinfer.core.sequence import Sequence  # noqa: E402
from jaxinfer.sampling.params import SamplingParams  # noqa: E402
from jaxinfer.worker.inputs import InputBuilder  # noqa: E402

PAGE = 16


def measure(batch: int, context: int, windows: int, window: int) -> dict:
    max_len = context + windows * window + PAGE
    engine = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=batch, max_model_len=max_len, page_size=PAGE)
    pages_per_seq = -(-max_len // PAGE)
    builder = InputBuilder(engine, (batch,), pages_per_seq=pages_per_seq, max_model_len=max_len, vocab_size=49152)
    rng = np.random.default_rng(0)
    seqs, next_page = [], 1
    for i in range(batch):
        seq = Sequence(
            i, f"r{i}", rng.integers(1, 49152, context).tolist(), SamplingParams(temperature=0), seed=i, arrival=i
        )
        count = -(-(context + window) // PAGE)
        seq.pages, next_page = list(range(next_page, next_page + count)), next_page + count
        seq.num_computed_tokens = context - 1
        seqs.append(seq)
    prepare_s, tuples_s, sent = [], [], []
    for _ in range(windows):
        start = time.perf_counter()
        plan = SchedulerPlan(
            [ScheduledSeq(s, s.num_computed_tokens, 1, tuple(s.pages), sample=True) for s in seqs], num_steps=window
        )
        tuples_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        inputs = builder.prepare(plan, None, masks=False)
        prepare_s.append(time.perf_counter() - start)
        sent.append(sum(x.nbytes for x in jax.tree.leaves(inputs)))
        for s in seqs:  # the window's tokens land; the next window's pages are reserved
            s.token_ids += [7] * window
            s.num_computed_tokens += window
            need = -(-(s.num_computed_tokens + 1 + window) // PAGE) - len(s.pages)
            s.pages += list(range(next_page, next_page + max(need, 0)))
            next_page += max(need, 0)
    warm = slice(2, None)  # the first windows send every row
    return {
        "batch": batch,
        "context": context,
        "prepare_ms": 1e3 * statistics.median(prepare_s[warm]),
        "page_tuples_ms": 1e3 * statistics.median(tuples_s[warm]),
        "first_window_kib": sent[0] / 1024,
        "window_kib": statistics.median(sent[warm]) / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--windows", type=int, default=40)
    parser.add_argument("--window", type=int, default=8, help="decode steps per window")
    args = parser.parse_args()
    print(
        "| batch x context | prepare (ms) | plan's page tuples (ms) | inputs sent, first window (KiB) | "
        "inputs sent, later windows (KiB, median) |"
    )
    print("|---|---|---|---|---|")
    for context in args.contexts:
        r = measure(args.batch, context, args.windows, args.window)
        print(
            f"| {r['batch']} x {r['context']} | {r['prepare_ms']:.2f} | {r['page_tuples_ms']:.2f} | "
            f"{r['first_window_kib']:.0f} | {r['window_kib']:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
