"""What beam search costs against sampling the same number of sequences: one engine, one run.

    python benchmarks/bench_beam.py                       # SmolLM2 (embedded), width 4, 64 tokens
    python benchmarks/bench_beam.py --width 4 --prompts 2 --max-tokens 64 --rounds 3

Round after round, the same `--prompts` chat prompts run two ways, every request queued at once:
  sampled    SamplingParams(n=width, temperature=0.8, ignore_eos): width sequences per prompt
  beams      BeamSearchParams(beam_width=width, ignore_eos): width beams per prompt, which with
             ignore_eos run exactly max_tokens steps (no beam ends before)
Both make width x max_tokens tokens per prompt. Per way: tokens/s over the whole call (beam
search returns its beams only when done, so there is no first-token time to start from), medians
over --rounds (the first round compiles nothing: the engine warmed up, but it is not counted).
The ratio sampled / beams is the goal's measure (beams within 1.3x of sampling).
"""

from __future__ import annotations

import argparse
import statistics
import time

from jaxinfer.llm import LLM
from jaxinfer.sampling import SamplingParams
from jaxinfer.sampling.beam import BeamSearchParams

QUESTIONS = [
    "Give me three tips for sleeping better.",
    "Explain photosynthesis to a ten-year-old.",
    "Write a short email asking my manager for a day off next Friday.",
    "What is the capital of France? Answer in one sentence.",
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    llm = LLM(args.model, max_num_seqs=max(8, args.width * args.prompts))
    prompts = [
        llm.render_chat([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]) for i in range(args.prompts)
    ]
    sampled = SamplingParams(n=args.width, temperature=0.8, seed=0, max_tokens=args.max_tokens, ignore_eos=True)
    beams = BeamSearchParams(beam_width=args.width, max_tokens=args.max_tokens, ignore_eos=True)
    tokens = args.width * args.max_tokens * args.prompts
    rates: dict[str, list[float]] = {"sampled": [], "beams": []}
    for r in range(args.rounds + 1):
        start = time.perf_counter()
        llm.generate(prompts, sampled, use_tqdm=False)
        mid = time.perf_counter()
        outs = llm.beam_search(prompts, beams)
        end = time.perf_counter()
        assert all(len(s.token_ids) == args.max_tokens for o in outs for s in o.sequences)
        if r:  # round 0 warms the caches
            rates["sampled"].append(tokens / (mid - start))
            rates["beams"].append(tokens / (end - mid))
    sampled_rate, beam_rate = statistics.median(rates["sampled"]), statistics.median(rates["beams"])
    print(f"{args.prompts} prompts x width {args.width} x {args.max_tokens} tokens, rounds {args.rounds}")
    print("| way | tokens/s (median) | runs |")
    print("|---|---|---|")
    for way, runs in rates.items():
        print(f"| {way} | {statistics.median(runs):.1f} | {', '.join(f'{x:.1f}' for x in runs)} |")
    print(f"sampled / beams: {sampled_rate / beam_rate:.2f}x (goal <= 1.3x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
