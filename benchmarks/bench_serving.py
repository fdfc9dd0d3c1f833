"""Load generator for the server, over gRPC and/or the OpenAI-compatible HTTP API: Poisson
arrivals, a realistic prompt/output length mix, throughput and latency percentiles at several
request rates.

    python benchmarks/bench_serving.py                        # starts `jaxinfer serve` (default model)
    python benchmarks/bench_serving.py --rates 0.5,1,2,inf --num-requests 64
    python benchmarks/bench_serving.py --http                 # gRPC, then HTTP, at each rate; compared
    python benchmarks/bench_serving.py --transports http      # /v1/completions only
    python benchmarks/bench_serving.py --server 10.0.0.5:50051 --token-file tok   # an existing server
    python benchmarks/bench_serving.py --server HOST:50051 --http-server http://HOST:8000 --http
    python benchmarks/bench_serving.py --serve-args "--model /m.gguf --max-num-seqs 128"

Requests: prompt and output lengths are drawn from log-normal distributions (medians
--prompt-median / --output-median, clipped to the --max-* bounds; a few long prompts, many short
ones, as in chat traffic); prompts are windows of real text (the Python standard library's
source, tokenized by the server) sent as token ids so their lengths are exact; outputs run to
their drawn length (ignore_eos). Arrivals at rate r are a Poisson process (exponential gaps,
seeded); "inf" sends everything at once. The same request list is replayed at every rate.

Transports (--transports grpc,http, or --http for both): one server process serves both (started
with --port 0 --http-port 0), so both hit the same engine and weights. At each rate the transports
run one after another, not interleaved, with the same requests and the same arrival times; HTTP
sends them to /v1/completions with `stream: true` (serving_transports.py says how each side is
timed). Every request must produce exactly its max_tokens on either side, or it counts as failed.
With both, a comparison per rate follows: the HTTP/gRPC ratio of median ITL and the difference of
median TTFT, against the goal "HTTP adds < 5% to median ITL and < 10 ms to median TTFT".

Reported per rate and transport: request throughput, output tokens/s, time to first token (TTFT:
send to first token received), inter-token latency (ITL: gap between two streamed messages
carrying tokens), time per output token (TPOT: (e2e - TTFT) / (tokens - 1)) and end-to-end
latency percentiles, measured on the client. The server runs in its own process so the load
generator does not compete with it for the GIL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving_transports import GrpcTransport, HttpTransport, RequestResult, RequestSpec, ttft_overheads

# No prefix caching: the same requests are replayed at every rate and on every transport, so a
# cache would serve the later runs' prompts from the earlier ones' pages (an HTTP run after a
# gRPC one measured 300 ms lower TTFT from that alone).
DEFAULT_SERVE_ARGS = (
    "--no-penalties --max-model-len 2048 --max-num-seqs 32 --max-num-batched-tokens 256 "
    "--token-buckets 16,64,256 --no-prefix-caching"
)
TRANSPORTS = ("grpc", "http")
GOAL_ITL_RATIO, GOAL_TTFT_MS = 1.05, 10.0  # HTTP adds < 5% to median ITL, < 10 ms to median TTFT


def corpus_text(max_chars: int = 400_000) -> str:
    """Real English-and-code text that every Python installation has."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for name in (
        "argparse.py",
        "asyncio/events.py",
        "collections/__init__.py",
        "dataclasses.py",
        "inspect.py",
        "json/decoder.py",
        "logging/__init__.py",
        "pathlib.py",
        "subprocess.py",
        "typing.py",
    ):
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
        specs.append(RequestSpec(corpus_ids[start : start + p], int(o)))
    return specs


async def run_rate(transport, specs: list[RequestSpec], rate: float, seed: int, timeout: float):
    rng = np.random.default_rng(seed)
    gaps = np.zeros(len(specs)) if math.isinf(rate) else rng.exponential(1.0 / rate, len(specs))
    tasks = []
    start = time.perf_counter()
    for spec, gap in zip(specs, gaps):
        await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(transport.run_one(spec, timeout)))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def summarize(
    transport: str, rate: float, results: list[RequestResult], duration: float, overheads: list[float] = ()
) -> dict:
    ok = [r for r in results if r.ok]

    def pct(values, q):
        return float(np.percentile(values, q)) * 1000 if len(values) else math.nan

    ttft = [r.ttft for r in ok]
    itl = [x for r in ok for x in r.itls]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    e2e = [r.e2e for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "transport": transport,
        "rate": rate,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "token_mismatches": sum(r.wrong_length for r in results),
        "duration_s": duration,
        "output_tokens": out_tokens,
        "messages": sum(r.messages for r in ok),
        "request_throughput": len(ok) / duration,
        "output_tokens_per_s": out_tokens / duration,
        "total_tokens_per_s": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
        "ttft_ms": {q: pct(ttft, q) for q in (50, 90, 99)},
        "itl_ms": {q: pct(itl, q) for q in (50, 90, 99)},
        "tpot_ms": {q: pct(tpot, q) for q in (50, 90)},
        "e2e_ms": {q: pct(e2e, q) for q in (50, 99)},
        # client TTFT - the server's (request log), per request: what the transport itself costs
        "ttft_overhead_ms": {q: pct(overheads, q) for q in (50, 90)},
        "overhead_samples": len(overheads),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
    }


def compare(rows: list[dict]) -> list[dict]:
    """Per rate with both transports: HTTP / gRPC median ITL, HTTP - gRPC median TTFT (ms)."""
    by_rate: dict[float, dict[str, dict]] = {}
    for r in rows:
        by_rate.setdefault(r["rate"], {})[r["transport"]] = r
    out = []
    for rate, pair in by_rate.items():
        if set(pair) != set(TRANSPORTS):
            continue
        g, h = pair["grpc"], pair["http"]
        itl_ratio = h["itl_ms"][50] / g["itl_ms"][50] if g["itl_ms"][50] else math.nan
        ttft_diff = h["ttft_ms"][50] - g["ttft_ms"][50]
        overhead_diff = h["ttft_overhead_ms"][50] - g["ttft_overhead_ms"][50]  # nan without a log
        # what HTTP adds to TTFT: the overheads' difference where the log gave them, else the raw TTFTs'
        added = ttft_diff if math.isnan(overhead_diff) else overhead_diff
        same_work = g["failed"] == h["failed"] == 0 and g["output_tokens"] == h["output_tokens"]
        out.append(
            {
                "rate": rate,
                "itl_p50_ratio": itl_ratio,
                "ttft_p50_diff_ms": ttft_diff,
                "ttft_overhead_p50_diff_ms": overhead_diff,
                "ttft_added_ms": added,
                "same_work": same_work,
                "output_tokens": {"grpc": g["output_tokens"], "http": h["output_tokens"]},
                "messages": {"grpc": g["messages"], "http": h["messages"]},
                "within_goal": same_work and itl_ratio < GOAL_ITL_RATIO and added < GOAL_TTFT_MS,
            }
        )
    return out


def markdown(rows: list[dict]) -> str:
    head = (
        "| rate (req/s) | transport | req | failed | req/s | out tok/s | TTFT p50 / p90 / p99 (ms) "
        "| ITL p50 / p90 / p99 (ms) | TPOT p50 (ms) | E2E p50 / p99 (s) | TTFT overhead p50 / p90 (ms) |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        t, i = r["ttft_ms"], r["itl_ms"]
        lines.append(
            f"| {r['rate']:g} | {r['transport']} | {r['requests']} | {r['failed']} | "
            f"{r['request_throughput']:.2f} | {r['output_tokens_per_s']:.1f} | "
            f"{t[50]:.0f} / {t[90]:.0f} / {t[99]:.0f} | {i[50]:.0f} / {i[90]:.0f} / {i[99]:.0f} | "
            f"{r['tpot_ms'][50]:.0f} | {r['e2e_ms'][50] / 1000:.1f} / {r['e2e_ms'][99] / 1000:.1f} | "
            f"{r['ttft_overhead_ms'][50]:.1f} / {r['ttft_overhead_ms'][90]:.1f} |"
        )
    return "\n".join(lines)


def markdown_comparison(comparison: list[dict]) -> str:
    head = (
        f"| rate (req/s) | ITL p50 HTTP / gRPC | TTFT p50 HTTP - gRPC (ms) | TTFT overhead p50 HTTP - gRPC "
        f"(ms) | output tokens gRPC / HTTP | token messages gRPC / HTTP "
        f"| within goal (< {GOAL_ITL_RATIO - 1:.0%}, < {GOAL_TTFT_MS:g} ms) |"
    )
    lines = [head, "|" + "---|" * 7]
    for c in comparison:
        tokens, messages = c["output_tokens"], c["messages"]
        goal = "yes" if c["within_goal"] else ("no" if c["same_work"] else "no: different work (failed requests)")
        lines.append(
            f"| {c['rate']:g} | {c['itl_p50_ratio']:.3f} | {c['ttft_p50_diff_ms']:+.1f} | "
            f"{c['ttft_overhead_p50_diff_ms']:+.1f} | "
            f"{tokens['grpc']} / {tokens['http']} | {messages['grpc']} / {messages['http']} | {goal} |"
        )
    return "\n".join(lines)


def start_server(
    serve_args: str, transports: list[str], request_log: str
) -> tuple[subprocess.Popen, str | None, str | None]:
    """`jaxinfer serve` on free ports (gRPC, and HTTP too when asked), writing its request log to
    `request_log` -> (process, gRPC address, HTTP URL)."""
    http = "http" in transports
    cmd = [
        sys.executable,
        "-m",
        "jaxinfer.cli",
        "serve",
        "--port",
        "0",
        *(["--http-port", "0"] if http else []),
        "--request-log",
        request_log,
        *shlex.split(serve_args),
    ]
    print("starting:", " ".join(cmd), file=sys.stderr)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    line = proc.stdout.readline()
    grpc_address, http_url = listening_addresses(line)
    if (
        (grpc_address is None and http_url is None)
        or (http and http_url is None)
        or ("grpc" in transports and grpc_address is None)
    ):
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return proc, grpc_address, http_url


def listening_addresses(line: str) -> tuple[str | None, str | None]:
    """`serve`'s first line: "listening on HOST:PORT[ (http://HOST:PORT)][ (metrics on ...)]"."""
    words = [w.strip("()") for w in line.split()]
    if words[:2] != ["listening", "on"] or len(words) < 3:
        return None, None
    grpc_address = None if words[2].startswith("http://") else words[2]
    return grpc_address, next((w for w in words[2:] if w.startswith("http://")), None)


async def bench(args, token: str | None) -> list[dict]:
    # made inside the event loop: a grpc.aio channel belongs to the loop it was created on
    transports = [
        GrpcTransport(args.server, token) if name == "grpc" else HttpTransport(args.http_server, token)
        for name in args.transports
    ]
    try:
        for t in transports:
            model, max_model_len = await t.model_info()
            print(f"{t.name}: model {model} (max_model_len {max_model_len})", file=sys.stderr)
        corpus_ids = await transports[0].tokenize(corpus_text())
        print(f"corpus {len(corpus_ids)} tokens", file=sys.stderr)
        specs = make_requests(corpus_ids, args)
        for t in transports:  # compiled paths and connections warm before any rate is measured
            await asyncio.gather(*(t.run_one(s, args.timeout) for s in specs[: args.warmup]))
        rows = []
        for k, rate in enumerate(args.rates):
            for t in transports:  # one after another, the same requests and arrival times
                results, duration = await run_rate(t, specs, rate, args.seed + k, args.timeout)
                overheads = ttft_overheads(results, args.request_log) if args.request_log else []
                rows.append(summarize(t.name, rate, results, duration, overheads))
                print(markdown(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
        return rows
    finally:
        for t in transports:
            await t.close()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", default=None, help="HOST:PORT of a running server's gRPC (default: start one)")
    p.add_argument("--http-server", default=None, help="http://HOST:PORT of a running server's HTTP API")
    p.add_argument("--token-file", default=None, help="bearer token file of --server (and of --http-server)")
    p.add_argument(
        "--request-log",
        default=None,
        help="the request log of --server (its --request-log file), "
        "for the transport overhead; the server this starts writes one to a temporary file",
    )
    p.add_argument("--serve-args", default=DEFAULT_SERVE_ARGS, help="extra `jaxinfer serve` arguments")
    p.add_argument("--transports", default="grpc", help="comma-separated, run in this order: grpc, http")
    p.add_argument("--http", action="store_true", help="the same as --transports grpc,http")
    p.add_argument("--rates", default="0.5,1,2", help="comma-separated request rates (req/s); inf = all at once")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-median", type=int, default=128)
    p.add_argument("--output-median", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--warmup", type=int, default=2, help="requests sent (and not measured) first, per transport")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request deadline (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",")]
    args.transports = list(TRANSPORTS) if args.http else [t.strip() for t in args.transports.split(",") if t.strip()]
    if (
        not args.transports
        or any(t not in TRANSPORTS for t in args.transports)
        or len(set(args.transports)) < len(args.transports)
    ):
        p.error(f"--transports {','.join(args.transports)}: a list of distinct names from {', '.join(TRANSPORTS)}")
    if args.server is not None or args.http_server is not None:  # an existing server: each transport's address
        for name, flag, value in (("grpc", "--server", args.server), ("http", "--http-server", args.http_server)):
            if name in args.transports and value is None:
                p.error(f"--transports {','.join(args.transports)} with an existing server needs {flag}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    token = Path(args.token_file).read_text().strip() if args.token_file else os.environ.get("JAXINFER_AUTH_TOKEN")
    proc = None
    if args.server is None and args.http_server is None:
        log_dir = tempfile.mkdtemp(prefix="bench-serving-")
        args.request_log = os.path.join(log_dir, "requests.jsonl")
        proc, args.server, args.http_server = start_server(args.serve_args, args.transports, args.request_log)
    try:
        rows = asyncio.run(bench(args, token))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    comparison = compare(rows)
    print(markdown(rows))
    if comparison:
        print()
        print(markdown_comparison(comparison))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "results": rows, "comparison": comparison}, indent=2)
        )
    mismatched = sum(r["token_mismatches"] for r in rows)
    if mismatched:
        print(
            f"error: {mismatched} requests did not produce exactly max_tokens tokens (counted as failed): "
            "the transports did not measure the same work",
            file=sys.stderr,
        )
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
