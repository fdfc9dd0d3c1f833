"""What prompt logprobs cost: prompt tokens per second scored, beside the same prompts unscored.

    python benchmarks/bench_scoring.py                    # SmolLM2 (embedded), 16 prompts of 256 tokens
    python benchmarks/bench_scoring.py --model M --prompts 64 --prompt-len 1024 --repeats 5

One engine (started with enable_prompt_logprobs) runs each case over `--prompts` prompts of
random token ids, `--repeats` times in turn (medians); every prompt is new (nothing comes from the
prefix cache) and each request generates one token, as a loglikelihood job does:
  plain     no prompt logprobs: the prefill alone
  scored0   prompt_logprobs=0: each prompt token's logprob and rank (the LM head over every row)
  scoredN   prompt_logprobs=--top: and the N most likely tokens at each position
Prompt tokens per second for each and its ratio to plain; the engine's warm-up (the prompt
variants included) and its compiled variants, which must not grow while the cases run.

    python benchmarks/bench_scoring.py --per-bucket      # one request at a time, as lm-eval sends them

`--per-bucket`: lm-evaluation-harness's loglikelihood requests one at a time (`echo`,
`logprobs: 1`, `max_tokens: 1`: prompt_logprobs=1 here) at prompt lengths 4 .. 128, one row per
length: seconds per request scored and plain (medians of --repeats), on an engine with the
serving defaults (max_num_seqs 64).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--cache-dir", default="auto", help="compilation cache: a directory, none, or auto (as jaxinfer)")
    p.add_argument("--per-bucket", action="store_true", help="one request at a time per prompt length (lm-eval)")
    args = p.parse_args(argv)
    if args.per_bucket:
        return per_bucket(args)

    import jax

    from jaxinfer.llm import LLM
    from jaxinfer.sampling import SamplingParams

    llm = LLM(
        args.model,
        max_model_len=args.prompt_len + 16,
        max_num_seqs=args.prompts,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prompt_logprobs=True,
        penalties=False,
        compilation_cache_dir=args.cache_dir,
    )
    engine = llm.engine
    compiled = engine.worker.num_compiled()
    vocab = engine.model.config.vocab_size
    print(
        f"{jax.devices()[0].device_kind}, vocabulary {vocab}, {args.prompts} prompts of {args.prompt_len} "
        f"tokens, steps of {args.max_num_batched_tokens} tokens; warm-up {engine.warm_up_seconds:.1f}s, "
        f"{compiled} variants\n"
    )
    cases = {"plain": None, "scored0": 0, f"scored{args.top}": args.top}
    rng = np.random.default_rng(0)
    rates: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, top in cases.items():
            prompts = rng.integers(1, vocab, size=(args.prompts, args.prompt_len)).tolist()
            params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=top)
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            if top is not None:
                assert all(len(o.prompt_logprobs) == args.prompt_len for o in outs)
            assert all(o.usage.cached_prompt_tokens == 0 for o in outs)
            rates[name].append(args.prompts * args.prompt_len / seconds)
    print("| case | prompt tok/s (median) | vs plain |")
    print("|---|---|---|")
    plain = statistics.median(rates["plain"])
    for name in cases:
        rate = statistics.median(rates[name])
        print(f"| {name} | {rate:.0f} | {rate / plain:.2f}x |")
    grown = engine.worker.num_compiled() - compiled
    print(f"\ncompiled after warm-up: {grown}")
    return 0 if grown == 0 else 1


def per_bucket(args: argparse.Namespace) -> int:
    from jaxinfer.llm import LLM
    from jaxinfer.sampling import SamplingParams

    llm = LLM(args.model, enable_prompt_logprobs=True, compilation_cache_dir=args.cache_dir)
    engine, rng = llm.engine, np.random.default_rng(0)
    compiled, vocab = engine.worker.num_compiled(), engine.model.config.vocab_size
    print("| prompt tokens | scored, s/request | plain, s/request | scored vs plain |")
    print("|---|---|---|---|")
    for length in (4, 8, 16, 24, 32, 48, 64, 128):
        seconds: dict[str, list[float]] = {"scored": [], "plain": []}
        for _ in range(args.repeats + 1):  # the first of each is not counted
            for name, top in (("scored", 1), ("plain", None)):
                prompt = rng.integers(1, vocab, size=length).tolist()
                params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=top, logprobs=1)
                start = time.perf_counter()
                llm.generate([prompt], params, use_tqdm=False)
                seconds[name].append(time.perf_counter() - start)
        scored, plain = (statistics.median(seconds[n][1:]) for n in ("scored", "plain"))
        print(f"| {length} | {scored:.3f} | {plain:.3f} | {scored / plain:.2f}x |")
    grown = engine.worker.num_compiled() - compiled
    print(f"\ncompiled after warm-up: {grown}")
    return 0 if grown == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
