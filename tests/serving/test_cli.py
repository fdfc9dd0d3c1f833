"""`jaxinfer serve` as a real process: `jaxinfer client` against it, then SIGTERM with requests
in flight: they finish, and the process exits 0."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from testpaths import TINY_SERVE_ARGS

from serving.grpc.client import Client

JAXINFER = [sys.executable, "-m", "jaxinfer.cli"]
TINY_ARGS = TINY_SERVE_ARGS


def read_line(stream, timeout: float) -> str:
    """One line from a pipe, or fail after `timeout` seconds (the reader thread is a daemon)."""
    box = []
    reader = threading.Thread(target=lambda: box.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not box:
        pytest.fail(f"no line within {timeout} s")
    return box[0]


@pytest.fixture
def served(tmp_path):
    env = {**os.environ, "JAXINFER_AUTH_TOKEN": "tok", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [*JAXINFER, "serve", *TINY_ARGS, "--port", "0", "--metrics-port", "0", "--grace-period", "20"],
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / "err", "w"),
        text=True,
        env=env,
        cwd=Path(__file__).parents[2],
    )
    try:
        line = read_line(proc.stdout, 120)
        assert line.startswith("listening on 127.0.0.1:"), line + (tmp_path / "err").read_text()
        yield proc, line.split()[2], env
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_client_command_against_a_served_process(served):
    proc, address, env = served
    run = lambda *a, **kw: subprocess.run(
        [*JAXINFER, "client", "--server", address, *a], capture_output=True, text=True, timeout=60, env={**env, **kw}
    )
    out = run("generate", "--token-ids", "1,2,3", "--max-tokens", "4", "--ignore-eos")
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.split()) == 4
    out = run("stats")
    assert out.returncode == 0 and '"kv_pages_total": 47' in out.stdout
    out = run("generate", "--token-ids", "1,2", "--top-p", "3", "--max-tokens", "2")
    assert out.returncode == 1 and out.stderr.startswith("error: INVALID_ARGUMENT: sampling.top_p"), out.stderr
    out = run("info", JAXINFER_AUTH_TOKEN="bad")
    assert out.returncode == 1 and "UNAUTHENTICATED" in out.stderr
    out = run("health", JAXINFER_AUTH_TOKEN="")
    assert out.returncode == 0 and out.stdout.strip() == "SERVING"


def test_sigterm_lets_in_flight_requests_finish_and_exits_0(served):
    proc, address, _ = served
    results, errors = {}, []
    started = threading.Barrier(4)

    def run(k):
        try:
            with Client(address, token="tok") as client:
                tokens, finish = [], ""
                for i, msg in enumerate(
                    client.stream([1, 2, k], max_tokens=220, temperature=0, ignore_eos=True, timeout=120)
                ):
                    if i == 0:
                        started.wait(60)
                    tokens += msg.outputs[0].token_ids
                    finish = msg.outputs[0].finish_reason or finish
                results[k] = (len(tokens), finish, time.monotonic())
        except Exception as e:  # recorded, asserted below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    started.wait(60)  # every stream has its first message: all three are in flight
    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    for t in threads:
        t.join(120)
    assert proc.wait(60) == 0
    assert not errors, errors
    assert {k: r[:2] for k, r in results.items()} == {k: (220, "length") for k in range(3)}
    assert all(r[2] > signalled for r in results.values())  # they were still streaming after SIGTERM


def test_serve_compiles_in_the_background_unless_told_or_warming_up(tmp_path, capsys):
    """`serve` answers once a first request's buckets are in (--compile-in-background is its
    default; --no-compile-in-background waits for every variant); other commands keep the strict
    default; `serve --warm-up-only` compiles every variant before it exits."""
    from jaxinfer.cli import build_parser
    from serving.cli import cmd_serve

    parser = build_parser()
    assert parser.parse_args(["serve", *TINY_SERVE_ARGS]).compile_in_background is True
    assert parser.parse_args(["serve", *TINY_SERVE_ARGS, "--no-compile-in-background"]).compile_in_background is False
    assert parser.parse_args(["generate", *TINY_SERVE_ARGS, "hi"]).compile_in_background is False
    store = ["--executable-cache-dir", str(tmp_path / "store"), "--token-buckets", "1,2,4,8,16,32"]
    args = parser.parse_args(["serve", *TINY_SERVE_ARGS, *store, "--warm-up-only"])
    assert cmd_serve(args) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    # six buckets and the decode windows of the four decode-sized ones (background: two buckets)
    assert summary.startswith("10 step variants (10 compiled, 0 read)"), summary
