"""Disaggregated prefill/decode against plain replicas, both behind vllm-router, on a mixed
workload: chat requests (short prompts, streamed outputs) while long prompts keep arriving.

    python benchmarks/bench_pd.py                     # SmolLM2 (the embedded model), 60 s a topology
    python benchmarks/bench_pd.py --seconds 30 --long-every 4.0 --long-tokens 1024

Two topologies, each two `jaxinfer serve` processes pinned to a core each (taskset) with
vllm-router (the PyPI release the tests install) in front, on loopback:

    replicas   both servers plain; the router alternates requests (round_robin)
    pd         one --kv-role prefill, one --kv-role decode; the router's P/D mode sends every
               request to the first with max_tokens=1, then to the second with its pages' params

The same load runs on each: `--chat-clients` clients each sending, one after another, a streamed
completion of `--chat-tokens` random prompt tokens and `--chat-output` tokens (ignore_eos); and a
long prompt of `--long-tokens` tokens (`--long-output` tokens out) sent every `--long-every`
seconds. Measured on the client: each chat request's inter-token latencies (ITL: the gap between
two streamed chunks, shared by the tokens of the later one: a decode window streams several at
once), TTFT, and the long prompts' TTFT. Reported: medians and p99s per topology
and the ratio pd / replicas of the chat ITL p99 (goal: <= 0.5). Prefix caching is off on every
server (each prompt is new anyway).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ROUTER_VERSION = "0.1.17"
SERVE_ARGS = [
    "--no-penalties", "--no-prefix-caching", "--max-model-len", "2048", "--max-num-seqs", "16",
    "--max-num-batched-tokens", "256", "--token-buckets", "16,64,256", "--no-grpc", "--http-port", "0",
    "--served-model-name", "m",
]  # fmt: skip


def router_path() -> Path:
    cache = (
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxinfer" / f"vllm-router-{ROUTER_VERSION}"
    )
    if not (cache / "vllm_router").is_dir():
        pip = [sys.executable, "-m", "pip", "install", "-q", "--target", str(cache), f"vllm-router=={ROUTER_VERSION}"]
        subprocess.run(pip, check=True)
    return cache


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(core: int, extra: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    cmd = ["taskset", "-c", str(core), sys.executable, "-m", "jaxinfer.cli", "serve", *SERVE_ARGS, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, cwd=ROOT)
    line = proc.stdout.readline()
    match = re.search(r"(http://[^\s)]+)", line)
    if not match:
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r}\n{log.read_text()[-3000:]}")
    return proc, match.group(1)


def start_router(args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(router_path())}
    cmd = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                return proc, url
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the router did not come up: {log.read_text()[-2000:]}")


def stream(url: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    """(TTFT, inter-token latencies) of one streamed completion, in seconds. A chunk may carry
    several tokens (a decode window's): its gap is shared evenly by its tokens (counted by their
    logprobs), as if they had come one by one."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    body["logprobs"] = 0  # each chunk's tokens listed
    data = json.dumps({**body, "stream": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data, {"Content-Type": "application/json"})
    start = last = time.perf_counter()
    ttft, gaps = None, []
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            tokens = len((choice.get("logprobs") or {}).get("tokens") or [])
            if not tokens:
                continue
            now = time.perf_counter()
            if ttft is None:
                ttft, tokens = now - start, tokens - 1  # the first token's time is the TTFT
            if tokens:
                gaps += [(now - last) / tokens] * tokens
            last = now
    return ttft if ttft is not None else float("nan"), gaps


def run_load(url: str, args: argparse.Namespace, seed: int) -> dict:
    rng = random.Random(seed)
    stop = time.monotonic() + args.seconds
    chat_gaps: list[float] = []
    chat_ttft: list[float] = []
    long_ttft: list[float] = []
    lock = threading.Lock()

    def chat(i: int) -> None:
        local = random.Random(seed * 100 + i)
        while time.monotonic() < stop:
            prompt = [local.randrange(100, 40000) for _ in range(args.chat_tokens)]
            ttft, gaps = stream(url, prompt, args.chat_output)
            with lock:
                chat_ttft.append(ttft)
                chat_gaps.extend(gaps)

    def long_prompts() -> None:
        threads = []
        while time.monotonic() < stop:
            prompt = [rng.randrange(100, 40000) for _ in range(args.long_tokens)]

            def one(p=prompt):
                ttft, _ = stream(url, p, args.long_output)
                with lock:
                    long_ttft.append(ttft)

            threads.append(threading.Thread(target=one))
            threads[-1].start()
            time.sleep(args.long_every)
        for t in threads:
            t.join()

    workers = [threading.Thread(target=chat, args=(i,)) for i in range(args.chat_clients)]
    workers.append(threading.Thread(target=long_prompts))
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    ms = lambda xs, q: float(np.percentile(xs, q) * 1e3) if xs else float("nan")  # noqa: E731
    return {
        "chat_requests": len(chat_ttft),
        "long_requests": len(long_ttft),
        "chat_itl_p50_ms": ms(chat_gaps, 50),
        "chat_itl_p99_ms": ms(chat_gaps, 99),
        "chat_ttft_p50_ms": ms(chat_ttft, 50),
        "chat_ttft_p99_ms": ms(chat_ttft, 99),
        "long_ttft_p50_ms": ms(long_ttft, 50),
    }


def topology(name: str, args: argparse.Namespace, logs: Path) -> dict:
    roles = (["--kv-role", "prefill"], ["--kv-role", "decode"]) if name == "pd" else ([], [])
    servers = [start_server(core, [*roles[core], *args.serve_args], logs / f"{name}-{core}.log") for core in (0, 1)]
    urls = [url for _, url in servers]
    if name == "pd":
        router_args = ["--vllm-pd-disaggregation", "--prefill", urls[0], "--decode", urls[1], "--policy", "round_robin"]
    else:
        router_args = ["--worker-urls", *urls, "--policy", "round_robin"]
    router, url = start_router(router_args, logs / f"{name}-router.log")
    try:
        stream(url, [101, 102, 103], 4)  # every path warm (the transfers' first use)
        stream(url, list(range(200, 200 + args.long_tokens)), 2)
        return run_load(url, args, seed=7)
    finally:
        router.kill()
        for proc, _ in servers:
            proc.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--chat-clients", type=int, default=4)
    p.add_argument("--chat-tokens", type=int, default=32)
    p.add_argument("--chat-output", type=int, default=32)
    p.add_argument("--long-tokens", type=int, default=512)
    p.add_argument("--long-output", type=int, default=4)
    p.add_argument("--long-every", type=float, default=8.0)
    p.add_argument("--serve-args", type=lambda s: s.split(), default=[])
    p.add_argument("--topologies", default="replicas,pd")
    args = p.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.topologies.split(","):
            results[name] = topology(name, args, Path(tmp))
            print(name, json.dumps(results[name]), flush=True)
    if {"replicas", "pd"} <= set(results):
        ratio = results["pd"]["chat_itl_p99_ms"] / results["replicas"]["chat_itl_p99_ms"]
        print(f"chat ITL p99, pd / replicas: {ratio:.2f}x (goal <= 0.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
