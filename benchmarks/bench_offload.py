"""What the prefix cache's host tier (`kv_offload_gb`) does for returning conversations.

    python benchmarks/bench_offload.py                           # SmolLM2 (embedded), CPU-sized
    python benchmarks/bench_offload.py --conversations 200 --turns 4 --user-tokens 64

A multi-turn chat replay, run twice on one loaded model: without the host tier, then with it.
Each turn sends every conversation's whole history plus a new user message (--user-tokens random
ids) and generates --reply-tokens greedily (ignore_eos), all conversations of a turn queued at
once. The device pool holds the final contexts of a quarter of the conversations (--pool-share),
so by the time a conversation returns its pages were evicted: without the tier it is prefilled
again, with it (--offload-gb, enough for every page) its pages come back from host memory.
Reported per way: the median time to first token of the returning turns (2 ..), the prompt
tokens served from the cache and from host memory, and the wall time of the replay; the goal's
measure is the ratio of the medians (host tier <= 0.5x without it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from jaxinfer.config import EngineConfig
from jaxinfer.engine import Engine
from jaxinfer.loader import load_model
from jaxinfer.sampling import SamplingParams


def replay(engine: Engine, args: argparse.Namespace, vocab: int) -> dict:
    rng = np.random.default_rng(0)
    history = [[] for _ in range(args.conversations)]
    ttft, cached, host, start = [], 0, 0, time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=args.reply_tokens, ignore_eos=True)
    for turn in range(args.turns):
        for c in range(args.conversations):
            history[c] += rng.integers(1, vocab, args.user_tokens).tolist()
            engine.add_request(list(history[c]), params, request_id=f"{turn}-{c}")
        final: dict = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id in final:
                    final[out.request_id].merge(out)
                else:
                    final[out.request_id] = out
        for c in range(args.conversations):
            out = final[f"{turn}-{c}"]
            history[c] += out.outputs[0].token_ids
            if turn:
                ttft.append(out.metrics.time_to_first_token)
                cached += out.usage.cached_prompt_tokens
                host += out.usage.host_cached_prompt_tokens
    return {"ttft_p50": statistics.median(ttft), "cached": cached, "host": host, "wall": time.perf_counter() - start}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--user-tokens", type=int, default=64)
    p.add_argument("--reply-tokens", type=int, default=8)
    p.add_argument("--pool-share", type=float, default=0.25)
    p.add_argument("--offload-gb", type=float, default=1.0)
    p.add_argument("--page-size", type=int, default=16)
    args = p.parse_args(argv)
    model = load_model(args.model, dtype="float32")
    final_len = args.turns * (args.user_tokens + args.reply_tokens)
    pages = int(args.conversations * args.pool_share * -(-final_len // args.page_size)) + 1
    options = dict(
        max_model_len=-(-final_len // args.page_size) * args.page_size,
        page_size=args.page_size,
        num_pages=max(pages, 2 * -(-final_len // args.page_size) + 1),
        max_num_seqs=8,
        max_num_batched_tokens=256,
        penalties=False,
    )
    results = {}
    for name, gb in (("without", 0.0), ("host tier", args.offload_gb)):
        engine = Engine(model, EngineConfig(**options, kv_offload_gb=gb))
        results[name] = replay(engine, args, model.config.vocab_size)
        r = results[name]
        print(
            f"{name:>10}: TTFT p50 of returning turns {r['ttft_p50'] * 1e3:.1f} ms, prompt tokens from the "
            f"cache {r['cached']} (host {r['host']}), replay {r['wall']:.1f} s",
            flush=True,
        )
    ratio = results["host tier"]["ttft_p50"] / results["without"]["ttft_p50"]
    print(f"ratio (host tier / without): {ratio:.2f}x; pool {options['num_pages'] - 1} pages of {args.page_size}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
