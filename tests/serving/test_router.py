"""Two `jaxinfer serve` processes behind vllm-router (the PyPI release, installed by the test
setup into a cache folder, started on loopback): every request answered under power_of_two (which
polls /get_load) and both servers used; one server killed mid-run, the router serves on with the
other; with kv_aware and the servers' KV events, a repeated long prefix goes to the server that
holds it."""

import concurrent.futures
import time
from pathlib import Path

import pytest
from openai_support import ServedProcess, metric
from router_support import Router, complete, free_port, install_router
from testpaths import TINY_SERVE_ARGS

PAGE = 16
MODEL_ARGS = [*TINY_SERVE_ARGS, "--page-size", str(PAGE), "--no-grpc", "--http-port", "0"]

LABELS = 'engine="0",model_name="llama3"'  # as the exposition orders them
pytestmark = pytest.mark.xdist_group("router")


@pytest.fixture(scope="module")
def router_path() -> Path:
    return install_router()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two servers publishing KV events (ports chosen free now)."""
    logs = tmp_path_factory.mktemp("servers")
    events = [free_port() for _ in range(2)]
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
        complete(holder.http, prefix + [11])  # the prefix cached on the second server, past the router
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
