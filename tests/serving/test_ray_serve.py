"""`jaxinfer serve --ray` on a local Ray cluster (started by the test): the OpenAI HTTP API from a
Ray Serve deployment of 2 engine replicas (the tiny Llama fixture with a chat template). 30
concurrent requests from the official `openai` client, streamed and not, all answered, by both
replicas within three such bursts (each replica's metrics read back from Ray's metrics export
port, tagged by replica); bad requests get the same status and error as `jaxinfer serve
--http-port`; SIGTERM removes the application and stops Serve."""

import concurrent.futures
import json
import re
import signal
import subprocess
import sys
import urllib.request

import pytest
from openai_support import REPO, ServedProcess, raw_request, wait_for
from ray_support import free_port, running_cluster
from testpaths import FIXTURES, TINY_SERVE_ARGS

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

MODEL = "llama3_chat"
ARGS = [str(FIXTURES / "hf" / MODEL) if arg.endswith("llama3") else arg for arg in TINY_SERVE_ARGS]
BAD = [
    {"model": MODEL, "prompt": "hi", "max_tokens": -1},
    {"model": MODEL, "prompt": "hi", "top_p": 2},
    {"model": "nope", "prompt": "hi"},
    {"model": MODEL},
]


@pytest.fixture(scope="module")
def cluster():
    yield from running_cluster()


@pytest.fixture(scope="module")
def deployed(cluster, tmp_path_factory):
    """`jaxinfer serve --ray ADDRESS --replicas 2`: (process, its URL)."""
    port = free_port()
    cmd = [sys.executable, "-m", "jaxinfer.cli", "serve", *ARGS, "--no-grpc", "--http-port", str(port)]
    cmd += ["--ray", cluster.address, "--replicas", "2"]
    log = tmp_path_factory.mktemp("ray-serve") / "serve.log"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, cwd=REPO)
    line = proc.stdout.readline()
    if not re.match(r"listening on http://127\.0\.0\.1:\d+ \(Ray Serve, 2 replicas\)", line):
        proc.kill()
        pytest.fail(f"no 'listening on' line: {line!r}\n{log.read_text()[-4000:]}")
    yield proc, f"http://127.0.0.1:{port}"
    if proc.poll() is None:
        proc.kill()


def replica_requests(cluster) -> dict[str, float]:
    """ray_jaxinfer_requests_total per replica, from the node's metrics export port."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=10).read().decode()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("ray_jaxinfer_requests_total{"):
            replica = re.search(r'replica="([^"]+)"', line).group(1)
            counts[replica] = counts.get(replica, 0.0) + float(line.split()[-1])
    return counts


def test_30_concurrent_requests_from_both_replicas(cluster, deployed):
    _, url = deployed
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)

    def ask(i: int) -> str:
        if i % 3 == 0:
            chat = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Hi {i}"}], max_tokens=8, stream=i % 2 == 0
            )
            if i % 2:
                return chat.choices[0].finish_reason
            return [c.choices[0].finish_reason for c in chat if c.choices and c.choices[0].finish_reason][-1]
        stream = i % 2 == 0
        out = client.completions.create(model=MODEL, prompt=f"Count {i}", max_tokens=8, temperature=0, stream=stream)
        if not stream:
            return out.choices[0].finish_reason
        return [c.choices[0].finish_reason for c in out if c.choices[0].finish_reason][-1]

    # Serve's router picks between the replicas by their queues as they answer its probes: on a
    # loaded 2-core machine one replica has taken a whole burst, so up to three bursts are sent
    # and both replicas must have served by then.
    before = sum(replica_requests(cluster).values())
    for burst in range(1, 4):
        with concurrent.futures.ThreadPoolExecutor(30) as pool:
            reasons = list(pool.map(ask, range(30)))
        assert all(r in ("length", "stop") for r in reasons), reasons
        sent = before + 30 * burst
        counts = wait_for(lambda: (c := replica_requests(cluster)) and sum(c.values()) >= sent and c, timeout=30)
        if len(counts) == 2 and all(v > 0 for v in counts.values()):
            break
    assert len(counts) == 2 and all(v > 0 for v in counts.values()), counts  # both replicas served


def test_bad_requests_get_what_serve_http_port_answers(deployed, tmp_path):
    _, url = deployed
    plain = ServedProcess([*ARGS, "--no-grpc", "--http-port", "0"], tmp_path / "plain.log")
    try:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        on_ray = type("Served", (), {"host": host, "port": port})
        for body in BAD:
            want_status, _, want = raw_request(plain, "POST", "/v1/completions", body)
            status, _, got = raw_request(on_ray, "POST", "/v1/completions", body)
            assert 400 <= status < 500 and status == want_status, (body, status, got)
            assert json.loads(got)["error"] == json.loads(want)["error"], body
    finally:
        plain.stop()


def test_sigterm_removes_the_application(cluster, deployed):
    proc, url = deployed
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    with pytest.raises(OSError):  # Serve's proxy is gone with the application
        urllib.request.urlopen(f"{url}/health", timeout=5)
