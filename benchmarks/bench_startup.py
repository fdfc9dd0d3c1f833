"""Start-up: from the command to the first answer, with empty caches and with warm ones.

    python benchmarks/bench_startup.py                    # every case, 2 warm rounds
    python benchmarks/bench_startup.py --cases generate --rounds 3
    python benchmarks/bench_startup.py --cases generate --jaxinfer "python3 -m jaxinfer.cli" --model DIR

Each case runs the installed `jaxinfer` (--jaxinfer, a command line; default: the venv's) in a new
process, on the embedded SmolLM2 (or --model, e.g. random weights of a GPU-sized shape), with
its own JAX compilation cache and executable store under --workdir:
"cold" starts with both empty, "warm" runs again over what the cold run left.

- generate: the README's first command (`jaxinfer generate --chat "What is the capital of
  France?"`), timed from start to exit.
- serve, serve-background: `jaxinfer serve --no-grpc --http-port 0` (with
  --compile-in-background for the second), timed from start to the first chat completion's
  answer (the client retries until the server listens); then the time until every step variant
  is ready (the /metrics gauges), and the server is stopped.

Prints one JSON line per run and a table of medians (warm) and the cold run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What is the capital of France?"


def env_for(workdir: Path, case: str) -> dict[str, str]:
    env = dict(os.environ)
    env["JAXINFER_COMPILATION_CACHE_DIR"] = str(workdir / case / "xla")
    env["JAXINFER_EXECUTABLE_CACHE_DIR"] = str(workdir / case / "executables")
    return env


def run_generate(jaxinfer: list[str], env: dict[str, str], model: list[str]) -> dict:
    start = time.perf_counter()
    out = subprocess.run([*jaxinfer, "generate", *model, "--chat", QUESTION], env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return {"first_answer_s": round(seconds, 2), "answer": out.stdout.strip()[:60]}


def _get(url: str, body: dict | None = None, timeout: float = 600) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()


def _progress(base: str) -> tuple[float, float]:
    values = {}
    for line in _get(f"{base}/metrics").decode().splitlines():
        if line.startswith("jaxinfer_step_variants_"):
            name, value = line.split()
            values[name] = float(value)
    return values.get("jaxinfer_step_variants_ready", 0.0), values.get("jaxinfer_step_variants_total", 0.0)


def run_serve(jaxinfer: list[str], env: dict[str, str], model: list[str], background: bool) -> dict:
    flags = ["serve", *model, "--no-grpc", "--http-port", "0", *(["--compile-in-background"] if background else [])]
    start = time.perf_counter()
    pipe, null = subprocess.PIPE, subprocess.DEVNULL
    server = subprocess.Popen([*jaxinfer, *flags], env=env, stdout=pipe, stderr=null, text=True)
    try:
        line = server.stdout.readline() if server.stdout else ""  # "listening on http://host:port ..."
        if "listening on" not in line:
            raise RuntimeError(f"serve did not start: {line!r}")
        base = line.split("listening on ", 1)[1].split()[0].rstrip("/")
        listening = time.perf_counter() - start
        ready_at_listen = _progress(base)
        model = json.loads(_get(f"{base}/v1/models"))["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 16, "temperature": 0}
        answer = json.loads(_get(f"{base}/v1/chat/completions", body))
        first = time.perf_counter() - start
        while True:
            ready, total = _progress(base)
            if ready >= total > 0:
                break
            time.sleep(0.5)
        return {
            "listening_s": round(listening, 2),
            "first_answer_s": round(first, 2),
            "all_variants_s": round(time.perf_counter() - start, 2),
            "variants_ready_at_listen": f"{ready_at_listen[0]:.0f}/{ready_at_listen[1]:.0f}",
            "answer": answer["choices"][0]["message"]["content"][:60],
        }
    finally:
        server.terminate()
        server.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jaxinfer", default=str(ROOT / ".venv" / "bin" / "jaxinfer"))
    parser.add_argument("--workdir", default="/tmp/jaxinfer-bench-startup")
    parser.add_argument("--cases", nargs="+", default=["generate", "serve", "serve-background"])
    parser.add_argument("--rounds", type=int, default=2, help="warm runs per case")
    parser.add_argument("--model", default=None, help="a checkpoint instead of the embedded default")
    args = parser.parse_args()
    jaxinfer, model = shlex.split(args.jaxinfer), (["--model", args.model] if args.model else [])
    workdir = Path(args.workdir)
    rows = []
    for case in args.cases:
        shutil.rmtree(workdir / case, ignore_errors=True)
        env = env_for(workdir, case)
        runs = []
        for i in range(1 + args.rounds):
            if case == "generate":
                result = run_generate(jaxinfer, env, model)
            else:
                result = run_serve(jaxinfer, env, model, background=case == "serve-background")
            result = {"case": case, "cache": "cold" if i == 0 else "warm", **result}
            print(json.dumps(result), flush=True)
            runs.append(result)
        warm = [r["first_answer_s"] for r in runs[1:]]
        rows.append((case, runs[0]["first_answer_s"], statistics.median(warm) if warm else None, runs))
    print("\n| case | cold: first answer (s) | warm: first answer, median (s) |")
    print("|---|---|---|")
    for case, cold, warm, _ in rows:
        print(f"| {case} | {cold} | {warm} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
