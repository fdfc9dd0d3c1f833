"""Two `jaxinfer serve` processes behind vllm-router (the PyPI release, installed by the test
setup into a cache folder, started on loopback): every request answered under power_of_two (which
polls /get_load) and both servers used; one server killed mid-run, the router serves on with the
other; with kv_aware and the servers' KV events, a repeated long prefix goes to the server that
holds it."""

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from openai_support import ServedProcess, metric, wait_for
from testpaths import TINY_SERVE_ARGS

ROUTER_VERSION = "0.1.17"
PAGE = 16
MODEL_ARGS = [*TINY_SERVE_ARGS, "--page-size", str(PAGE), "--no-grpc", "--http-port", "0"]

LABELS = 'engine="0",model_name="llama3"'  # as the exposition orders them
pytestmark = pytest.mark.xdist_group("router")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def router_path() -> Path:
    """vllm-router's package folder: pip-installed once into the user's cache (the test's setup),
    through a temporary folder renamed when complete."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxinfer"
    target = cache / f"vllm-router-{ROUTER_VERSION}"
    if not (target / "vllm_router").is_dir():
        staging = cache / f"vllm-router-{ROUTER_VERSION}.{os.getpid()}"
        pip = [sys.executable, "-m", "pip", "install", "-q", "--target", str(staging), f"vllm-router=={ROUTER_VERSION}"]
        done = subprocess.run(pip, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            reason = f"vllm-router {ROUTER_VERSION} could not be installed from the package index"
            pytest.skip(f"{reason}: {done.stderr[-400:]}")
        staging.rename(target)
    return target


class Router:
    def __init__(self, path: Path, args: list[str], log: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(path)}
        cmd = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen([*cmd, *args], stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
        self.log = log
        wait_for(self._healthy, timeout=60, interval=0.2)

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"vllm-router exited: {self.log.read_text()[-3000:]}")
        try:
            return urllib.request.urlopen(f"{self.url}/health", timeout=2).status == 200
        except (urllib.error.URLError, OSError):
            return False

    def complete(self, prompt: list[int]) -> dict:
        return _complete(self.url, prompt)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two servers publishing KV events (ports chosen free now)."""
    logs = tmp_path_factory.mktemp("servers")
    events = [_free_port() for _ in range(2)]
    started = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both load and compile at once
        futures = [
            pool.submit(
                ServedProcess,
                [*MODEL_ARGS, "--served-model-name", "llama3", "--kv-events-endpoint", f"tcp://127.0.0.1:{port}"],
                logs / f"server{i}.log",
            )
            for i, port in enumerate(events)
        ]
        started = [f.result() for f in futures]
    for server, port in zip(started, events):
        server.events = f"tcp://127.0.0.1:{port}"
    yield started
    for server in started:
        server.stop()


def _complete(url: str, prompt: list[int], max_tokens: int = 8) -> dict:
    body = {"model": "llama3", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _prompt(i: int, length: int = 20) -> list[int]:
    return [(7 * i + 3 * j) % 500 + 1 for j in range(length)]


def test_kv_aware_routes_a_repeated_prefix_to_the_server_holding_it(router_path, servers, tmp_path):
    args = ["--policy", "kv_aware", "--kv-event-model", "llama3", "--kv-event-block-size", str(PAGE)]
    for server in servers:
        args += ["--kv-event-source", f"{server.http}={server.events}"]
    router = Router(router_path, ["--worker-urls", *(s.http for s in servers), *args], tmp_path / "router.log")
    try:
        prefix = _prompt(1000, 5 * PAGE)  # five full pages
        # The second server: without the events, the router's tie between equal costs sends
        # every request to the first (checked by hand: all six went there).
        holder, other = servers[1], servers[0]
        _complete(holder.http, prefix + [11])  # the prefix cached on the second server, past the router
        hits = [metric(s, "vllm:prefix_cache_hits_total", LABELS) for s in servers]
        time.sleep(1.0)  # its pages' KV events reach the router
        for k in range(6):
            router.complete(prefix + [20 + k])
        after = [metric(s, "vllm:prefix_cache_hits_total", LABELS) for s in servers]
        assert after[1] - hits[1] == 6 * 5 * PAGE, (hits, after)  # each repeat found its five pages there
        assert after[0] == hits[0] and metric(other, "vllm:num_requests_running", LABELS) == 0
    finally:
        router.stop()


def test_power_of_two_spreads_the_load_and_survives_a_server_killed(router_path, servers, tmp_path):
    args = ["--worker-urls", *(s.http for s in servers), "--policy", "power_of_two"]
    # Health checks every second, one failure marks a server down; ten attempts a request (backoff
    # from 50 ms, x1.5: some 5 s in all) outlast that, so a request the dead server fails is retried
    # until the router sends it to the live one (power_of_two may pick the dead one again before).
    args += ["--worker-startup-check-interval", "1", "--health-check-interval-secs", "1"]
    args += ["--health-failure-threshold", "1", "--retry-max-retries", "10"]
    router = Router(router_path, args, tmp_path / "router.log")
    try:
        before = [metric(s, "jaxinfer_requests_total", 'finish_reason="length"') for s in servers]
        with concurrent.futures.ThreadPoolExecutor(40) as pool:
            outs = list(pool.map(lambda i: router.complete(_prompt(i)), range(40)))
        assert all(o["usage"]["completion_tokens"] == 8 for o in outs)
        served = [metric(s, "jaxinfer_requests_total", 'finish_reason="length"') - b for s, b in zip(servers, before)]
        assert sum(served) == 40 and min(served) > 0, served  # both servers took some
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            later = [pool.submit(router.complete, _prompt(100 + i)) for i in range(16)]
            servers[1].stop()  # SIGKILL while these are on their way, the router still listing it
            assert all(f.result().get("usage", {}).get("completion_tokens") == 8 for f in later)
        assert all(router.complete(_prompt(200 + i))["usage"]["completion_tokens"] == 8 for i in range(4))
    finally:
        router.stop()
