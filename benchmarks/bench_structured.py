"""What structured output costs: decode throughput with and without a grammar, and mask time.

    python benchmarks/bench_structured.py                # SmolLM2 (embedded), batch 32, 64 tokens
    python benchmarks/bench_structured.py --batch 8 --max-tokens 128 --repeats 5

One engine serves four runs of `--batch` requests side by side, each `--repeats` times (medians):
  free      unconstrained, the default loop (async scheduling, decode windows)
  sync      unconstrained, one step at a time with every token on the host first (the loop a
            constrained batch runs without the split step: its masks need the token before)
  regex     every request constrained by a regex of exactly N letters (no early end)
  json      every request constrained by a JSON schema (nested object, array, enum)
  tools     every request a chat's tool_choice "required" over 8 tools (the JSON list of calls
            serving/tools.py asks for: anyOf over each tool's name and parameters)
Output tokens per second for each, the host time spent filling masks per constrained token
(llguidance's fill_next_token_bitmask, measured around jaxinfer.worker.inputs' call), and the time to
compile each run's grammar once (a request whose spec is not in the cache pays it).
"""

from __future__ import annotations

import argparse
import statistics
import time

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["title", "tags", "meta"],
    "properties": {
        "title": {"type": "string"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
        "meta": {"type": "object", "properties": {"n": {"type": "integer"}}},
    },
}


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "parameters": {
                "type": "object",
                "additionalProperties": False,
                "required": ["query", "limit"],
                "properties": {
                    "query": {"type": "string", "maxLength": 40},
                    "limit": {"type": "integer"},
                    "mode": {"enum": ["fast", "exact", f"mode_{i}"]},
                },
            },
        },
    }
    for i in range(8)
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--runs", default="free,sync,regex,json,tools", help="which runs, in this order")
    p.add_argument(
        "--overlap",
        choices=["auto", "on", "off"],
        default="auto",
        help="structured_output_overlap: fill masks while the step's forward runs "
        "(the split step; auto: on accelerators only)",
    )
    args = p.parse_args(argv)

    import jaxinfer.worker.inputs as inputs_module
    from jaxinfer.llm import LLM
    from jaxinfer.sampling import SamplingParams, StructuredOutput
    from serving.tools import tool_request

    mask = {"seconds": 0.0, "rows": 0}
    fill = inputs_module.fill_bitmask

    def timed_fill(rows, allowed, *rest):
        start = time.perf_counter()
        fill(rows, allowed, *rest)
        mask["seconds"] += time.perf_counter() - start
        mask["rows"] += len(rows)

    inputs_module.fill_bitmask = timed_fill
    llm = LLM(
        max_model_len=1024,
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(256, args.batch),
        structured_output_overlap={"on": True, "off": False}.get(args.overlap),
    )
    prompt = [{"role": "user", "content": "Write a short note about the sea."}]
    runs = {
        "free": (SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.8, seed=1), {}),
        "sync": (
            SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.8, seed=1),
            {"async_scheduling": False, "num_decode_steps": 1},
        ),
        "regex": (
            SamplingParams(
                max_tokens=args.max_tokens,
                temperature=0.8,
                seed=1,
                structured_output=StructuredOutput(regex=f"[a-z ]{{{args.max_tokens * 4}}}"),
            ),
            {},
        ),
        "json": (
            SamplingParams(
                max_tokens=args.max_tokens, temperature=0.8, seed=1, structured_output=StructuredOutput(json=SCHEMA)
            ),
            {},
        ),
        "tools": (
            SamplingParams(
                max_tokens=args.max_tokens,
                temperature=0.8,
                seed=1,
                structured_output=tool_request(TOOLS, "required", None, None).structured_output,
            ),
            {},
        ),
    }
    engine = llm.engine
    defaults = (engine.config, engine.worker.step.num_decode_steps)
    split = bool(engine.worker.step.split_buckets)
    print(
        f"batch {args.batch}, {args.max_tokens} tokens, decode windows of {engine.worker.step.num_decode_steps}; "
        f"constrained rows {'fill masks while the forward runs (split step)' if split else 'land each step first'}\n"
    )
    compile_ms = {}
    for name in args.runs.split(","):
        spec = runs[name][0].structured_output
        if spec is not None:
            start = time.perf_counter()
            engine.grammars.compile(spec)
            compile_ms[name] = 1e3 * (time.perf_counter() - start)
    print("| run | output tok/s (median) | tokens | mask ms/token | grammar compile ms | vs the first run |")
    print("|---|---|---|---|---|---|")
    rates_by_run = {}
    for name in args.runs.split(","):
        params, loop = runs[name]
        rates, mask_per_token = [], []
        for _ in range(args.repeats):
            _set_loop(engine, defaults, loop)
            mask.update(seconds=0.0, rows=0)
            start = time.perf_counter()
            outs = llm.chat([prompt] * args.batch, [params] * args.batch, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            rates.append(tokens / seconds)
            mask_per_token.append(1e3 * mask["seconds"] / max(mask["rows"], 1))
        rate = rates_by_run[name] = statistics.median(rates)
        first = next(iter(rates_by_run.values()))
        compiled = f"{compile_ms[name]:.0f}" if name in compile_ms else "-"
        print(
            f"| {name} | {rate:.1f} | {tokens} | {statistics.median(mask_per_token):.3f} | {compiled} | "
            f"{rate / first:.2f}x |",
            flush=True,
        )
    return 0


def _set_loop(engine, defaults, loop: dict) -> None:

    config, steps = defaults
    engine.config = config.replace(async_scheduling=loop.get("async_scheduling", config.scheduler.async_scheduling))
    engine.worker.step.num_decode_steps = loop.get("num_decode_steps", steps)


if __name__ == "__main__":
    raise SystemExit(main())
