"""Load generator for the gRPC server: Poisson arrivals, a realistic prompt/output length mix,
throughput and latency percentiles at several request rates.

    python benchmarks/bench_serving.py                        # starts `jaxinfer serve` (default model)
    python benchmarks/bench_serving.py --rates 0.5,1,2,inf --num-requests 64
    python benchmarks/bench_serving.py --server 10.0.0.5:50051 --token-file tok   # an existing server
    python benchmarks/bench_serving.py --serve-args "--model /m.gguf --max-num-seqs 128"

Requests: prompt and output lengths are drawn from log-normal distributions (medians
--prompt-median / --output-median, clipped to the --max-* bounds; a few long prompts, many short
ones, as in chat traffic); prompts are windows of real text (the Python standard library's
source, tokenized by the server) sent as token ids so their lengths are exact; outputs run to
their drawn length (ignore_eos). Arrivals at rate r are a Poisson process (exponential gaps,
seeded); "inf" sends everything at once. The same request list is replayed at every rate.

Reported per rate: request throughput, output tokens/s, time to first token (TTFT: send to first
token received), inter-token latency (ITL: gap between two streamed messages carrying tokens), time
per output token (TPOT: (e2e - TTFT) / (tokens - 1)) and end-to-end latency percentiles, measured
on the client. The server runs in its own process so the load generator does not compete with it
for the GIL.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import shlex
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving.client import AsyncClient  # noqa: E402

DEFAULT_SERVE_ARGS = ("--no-penalties --max-model-len 2048 --max-num-seqs 32 --max-num-batched-tokens 256 "
                      "--token-buckets 16,64,256")


@dataclasses.dataclass
class RequestSpec:
    prompt: list[int]
    max_tokens: int


@dataclasses.dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float = math.nan
    e2e: float = math.nan
    itls: list[float] = dataclasses.field(default_factory=list)
    error: str = ""


def corpus_text(max_chars: int = 400_000) -> str:
    """Real English-and-code text that every Python installation has."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for name in ("argparse.py", "asyncio/events.py", "collections/__init__.py", "dataclasses.py", "inspect.py",
                 "json/decoder.py", "logging/__init__.py", "pathlib.py", "subprocess.py", "typing.py"):
        path = stdlib / name
        if path.is_file():
            parts.append(path.read_text(encoding="utf-8", errors="replace"))
            size += len(parts[-1])
        if size >= max_chars:
            break
    return "\n".join(parts)[:max_chars]


def make_requests(corpus_ids: list[int], args) -> list[RequestSpec]:
    rng = np.random.default_rng(args.seed)

    def lognormal(median, sigma, low, high, n):
        return np.clip(np.round(rng.lognormal(math.log(median), sigma, n)), low, high).astype(int)

    prompt_lens = lognormal(args.prompt_median, 0.9, 8, args.max_prompt, args.num_requests)
    output_lens = lognormal(args.output_median, 0.7, 4, args.max_output, args.num_requests)
    specs = []
    for p, o in zip(prompt_lens, output_lens):
        start = int(rng.integers(0, len(corpus_ids) - p))
        specs.append(RequestSpec(corpus_ids[start:start + p], int(o)))
    return specs


async def run_one(client: AsyncClient, spec: RequestSpec, timeout: float) -> RequestResult:
    result = RequestResult(ok=False, prompt_tokens=len(spec.prompt))
    sent = last = time.perf_counter()
    try:
        async for msg in client.stream(spec.prompt, max_tokens=spec.max_tokens, temperature=0.0,
                                       ignore_eos=True, timeout=timeout):
            n = sum(len(d.token_ids) for d in msg.outputs)
            now = time.perf_counter()
            if n and result.output_tokens == 0:
                result.ttft = now - sent
            elif n:
                result.itls.append(now - last)
            if n:
                last = now
            result.output_tokens += n
        result.e2e = time.perf_counter() - sent
        result.ok = True
    except Exception as e:  # a failed request is counted, not fatal
        result.error = f"{type(e).__name__}: {getattr(e, 'details', lambda: e)()}"
    return result


async def run_rate(client: AsyncClient, specs: list[RequestSpec], rate: float, seed: int, timeout: float):
    rng = np.random.default_rng(seed)
    gaps = np.zeros(len(specs)) if math.isinf(rate) else rng.exponential(1.0 / rate, len(specs))
    tasks = []
    start = time.perf_counter()
    for spec, gap in zip(specs, gaps):
        await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(run_one(client, spec, timeout)))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def summarize(rate: float, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    pct = lambda values, q: float(np.percentile(values, q)) * 1000 if len(values) else math.nan  # noqa: E731
    ttft = [r.ttft for r in ok]
    itl = [x for r in ok for x in r.itls]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    e2e = [r.e2e for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "rate": rate, "requests": len(results), "failed": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_tokens_per_s": out_tokens / duration,
        "total_tokens_per_s": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
        "ttft_ms": {q: pct(ttft, q) for q in (50, 90, 99)}, "itl_ms": {q: pct(itl, q) for q in (50, 90, 99)},
        "tpot_ms": {q: pct(tpot, q) for q in (50, 90)}, "e2e_ms": {q: pct(e2e, q) for q in (50, 99)},
        "errors": sorted({r.error for r in results if not r.ok})[:3],
    }


def markdown(rows: list[dict]) -> str:
    head = ("| rate (req/s) | req | failed | req/s | out tok/s | TTFT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms)"
            " | TPOT p50 (ms) | E2E p50 / p99 (s) |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        t, i = r["ttft_ms"], r["itl_ms"]
        lines.append(f"| {r['rate']:g} | {r['requests']} | {r['failed']} | {r['request_throughput']:.2f} | "
                     f"{r['output_tokens_per_s']:.1f} | {t[50]:.0f} / {t[90]:.0f} / {t[99]:.0f} | "
                     f"{i[50]:.0f} / {i[90]:.0f} / {i[99]:.0f} | {r['tpot_ms'][50]:.0f} | "
                     f"{r['e2e_ms'][50] / 1000:.1f} / {r['e2e_ms'][99] / 1000:.1f} |")
    return "\n".join(lines)


def start_server(serve_args: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "jaxinfer.cli", "serve", "--port", "0", *shlex.split(serve_args)]
    print("starting:", " ".join(cmd), file=sys.stderr)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    line = proc.stdout.readline()
    if not line.startswith("listening on "):
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return proc, line.split()[2]


async def bench(address: str, token: str | None, args) -> list[dict]:
    async with AsyncClient(address, token=token) as client:
        corpus_ids = await client.tokenize(corpus_text(), add_special_tokens=False)
        info = await client.model_info()
        print(f"model {info.model} (max_model_len {info.max_model_len}); corpus {len(corpus_ids)} tokens",
              file=sys.stderr)
        specs = make_requests(corpus_ids, args)
        if args.warmup:
            await asyncio.gather(*(run_one(client, s, args.timeout) for s in specs[:args.warmup]))
        rows = []
        for k, rate in enumerate(args.rates):
            results, duration = await run_rate(client, specs, rate, args.seed + k, args.timeout)
            rows.append(summarize(rate, results, duration))
            print(markdown(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
        return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", default=None, help="HOST:PORT of a running server (default: start one)")
    p.add_argument("--token-file", default=None, help="bearer token file of --server")
    p.add_argument("--serve-args", default=DEFAULT_SERVE_ARGS, help="extra `jaxinfer serve` arguments")
    p.add_argument("--rates", default="0.5,1,2", help="comma-separated request rates (req/s); inf = all at once")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-median", type=int, default=128)
    p.add_argument("--output-median", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--warmup", type=int, default=2, help="requests sent (and not measured) first")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request deadline (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",")]
    token = Path(args.token_file).read_text().strip() if args.token_file else os.environ.get("JAXINFER_AUTH_TOKEN")
    proc = None
    if args.server is None:
        proc, args.server = start_server(args.serve_args)
    try:
        rows = asyncio.run(bench(args.server, token, args))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
