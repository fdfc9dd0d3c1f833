"""What speculative decoding buys at batch 1: decode tokens/s with and without drafts, one engine.

    python benchmarks/bench_spec.py                              # SmolLM2 (embedded), n-gram, k=4
    python benchmarks/bench_spec.py --k 6 --max-tokens 192 --repeats 3
    python benchmarks/bench_spec.py --method draft_model --draft-model PATH

One LLM with speculation on serves every request twice, one at a time (batch 1, greedy): with
`speculative=False` (plain decoding: async scheduling and decode windows, the default loop) and
with drafts. Two prompt sets, rendered with the chat template:
  copy      copy-heavy tasks: repeating a text, editing a paragraph, renaming in code, continuing
            code that repeats a pattern (the output reuses long stretches of the prompt)
  chat      ordinary questions (little to copy; the acceptance rate is the number to watch)
Per prompt: output tokens, decode tokens/s of each run (tokens after the first over the time from
the first to the last token; medians over --repeats), the speedup, the acceptance rate and the
mean tokens per verify step. Greedy outputs of the two runs must be identical (checked).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

TEXT = (
    "The old mill stood at the bend of the river, where the water slowed and turned green "
    "under the willows. Every morning the miller opened the sluice, and the wheel began to "
    "turn with a low, steady sound that the whole village knew. Children crossed the river on "
    "the stepping stones below the mill, and in summer the river was so low that the stones "
    "stood dry in the sun."
)
CODE = """def summarize(records):
    total = 0
    count = 0
    for record in records:
        if record.get("valid"):
            total += record["value"]
            count += 1
    mean = total / count if count else 0.0
    return {"total": total, "count": count, "mean": mean}"""
PATTERN = """class Units:
    def meters_to_feet(self, value):
        return value * 3.28084

    def feet_to_meters(self, value):
        return value / 3.28084

    def kilograms_to_pounds(self, value):
        return value * 2.20462

    def pounds_to_kilograms(self, value):
        return value / 2.20462
"""
PROMPTS = {
    "copy": {
        "repeat": f"Repeat the following text exactly, word for word:\n\n{TEXT}",
        "edit": f"Rewrite this paragraph, replacing the word 'river' with 'canal' everywhere. Change "
        f"nothing else:\n\n{TEXT}",
        "rename": f"Rename the variable `total` to `acc` in this function and output the whole "
        f"function:\n\n```python\n{CODE}\n```",
        "continue": f"Continue this class with the methods liters_to_gallons and gallons_to_liters, "
        f"then repeat the whole class:\n\n```python\n{PATTERN}```",
    },
    "chat": {
        "capital": "What is the capital of France? Answer in one sentence.",
        "sleep": "Give me three tips for sleeping better.",
        "photosynthesis": "Explain photosynthesis to a ten-year-old.",
        "email": "Write a short email asking my manager for a day off next Friday.",
    },
}


def decode_rate(out) -> float:
    m, n = out.metrics, len(out.outputs[0].token_ids)
    return (n - 1) / (m.last_token_time - m.first_token_time) if n > 1 else 0.0


def run_prompt(llm, prompt, params, repeats):
    runs = {"plain": [], "spec": []}
    outs = {}
    for _ in range(repeats):
        for name, speculative in (("plain", False), ("spec", True)):
            out = llm.generate(prompt, dataclasses.replace(params, speculative=speculative), use_tqdm=False)[0]
            runs[name].append(decode_rate(out))
            outs[name] = out
    if outs["plain"].outputs[0].token_ids != outs["spec"].outputs[0].token_ids:
        raise SystemExit("greedy outputs differ with and without speculation")
    return {name: statistics.median(rates) for name, rates in runs.items()}, outs["spec"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--method", choices=["ngram", "draft_model"], default="ngram")
    p.add_argument("--draft-model", default=None, help="the draft model's path (method draft_model)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--lookup-max", type=int, default=4)
    p.add_argument("--lookup-min", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--sets", default="copy,chat")
    args = p.parse_args(argv)

    from jaxinfer.llm import LLM
    from jaxinfer.sampling import SamplingParams

    spec = {"method": args.method, "num_speculative_tokens": args.k}
    if args.method == "ngram":
        spec.update(prompt_lookup_max=args.lookup_max, prompt_lookup_min=args.lookup_min)
    else:
        spec["model"] = args.draft_model
    llm = LLM(
        args.model,
        args.dtype,
        max_model_len=1024,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        penalties=False,
        speculative_config=spec,
    )
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    print(f"speculative_config={spec}, batch 1, greedy, max_tokens={args.max_tokens}")
    print("| set | prompt | tokens | plain tok/s | spec tok/s | speedup | acceptance | tokens/verify step |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.sets.split(","):
        totals = {"plain": 0.0, "spec": 0.0, "tokens": 0, "drafted": 0, "accepted": 0, "steps": 0}
        for label, text in PROMPTS[name].items():
            rates, out = run_prompt(llm, llm.render_chat([{"role": "user", "content": text}]), params, args.repeats)
            m, n = out.metrics, len(out.outputs[0].token_ids)
            for key in ("plain", "spec"):
                totals[key] += (n - 1) / rates[key] if rates[key] else 0.0  # seconds
            totals["tokens"] += n - 1
            totals["drafted"] += m.num_draft_tokens
            totals["accepted"] += m.num_accepted_tokens
            totals["steps"] += m.num_verify_steps
            print(
                f"| {name} | {label} | {n} | {rates['plain']:.1f} | {rates['spec']:.1f} | "
                f"{rates['spec'] / rates['plain']:.2f}x | {m.acceptance_rate or 0:.2f} | "
                f"{m.mean_accepted_length or 1:.2f} |"
            )
        plain, fast = totals["tokens"] / totals["plain"], totals["tokens"] / totals["spec"]
        rate = totals["accepted"] / totals["drafted"] if totals["drafted"] else 0.0
        length = 1 + totals["accepted"] / totals["steps"] if totals["steps"] else 1.0
        print(
            f"| {name} | **all** | {totals['tokens']} | {plain:.1f} | {fast:.1f} | **{fast / plain:.2f}x** | "
            f"{rate:.2f} | {length:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
