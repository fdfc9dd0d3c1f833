"""Helpers of the HTTP API tests: `jaxinfer serve` as a subprocess, raw HTTP, server stats."""

import http.client
import json
import os
import re
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
from serving_support import wait_for as _wait_for

JAXINFER = [sys.executable, "-m", "jaxinfer.cli"]
REPO = Path(__file__).parents[2]


def _read_line(stream, timeout: float) -> str:
    box = []
    reader = threading.Thread(target=lambda: box.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return box[0] if box else ""


class ServedProcess:
    """`jaxinfer serve ARGS` until stop(); `grpc` / `http` are the addresses it printed."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None, timeout: float = 240):
        self.env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [*JAXINFER, "serve", *args],
            stdout=subprocess.PIPE,
            stderr=open(log_path, "w"),
            text=True,
            env=self.env,
            cwd=REPO,
        )
        line = _read_line(self.proc.stdout, timeout)
        match = re.match(r"listening on (?:(\S+:\d+) \()?(http://[^\s)]+)\)?", line)
        if not match:
            self.stop()
            pytest.fail(f"no 'listening on' line: {line!r}\n{self.log()}")
        self.grpc, self.http = match.group(1), match.group(2)
        self.host, self.port = self.http.removeprefix("http://").rsplit(":", 1)

    def log(self) -> str:
        return self.log_path.read_text()[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def raw_request(
    server: ServedProcess,
    method: str,
    path: str,
    body=None,
    key: str | None = None,
    headers: dict | None = None,
    timeout: float = 60,
) -> tuple[int, dict, bytes]:
    """(status, headers, body bytes) of one request over a fresh connection; `body` a dict is JSON."""
    conn = http.client.HTTPConnection(server.host, int(server.port), timeout=timeout)
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    if key:
        hdrs["Authorization"] = f"Bearer {key}"
    conn.request(method, path, body=json.dumps(body).encode() if isinstance(body, dict) else body, headers=hdrs)
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, data


def metric(server: ServedProcess, name: str, labels: str = "") -> float:
    """A sample of the server's /metrics (0.0 when absent)."""
    text = urllib.request.urlopen(f"{server.http}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(f"{name}{{{labels}}} " if labels else f"{name} "):
            return float(line.split()[-1])
    return 0.0


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.05):
    """serving_support.wait_for with a longer default (a subprocess server on a busy CPU)."""
    return _wait_for(predicate, timeout, interval)


def asgi_request(app, method: str, path: str, body=None, headers: dict | None = None) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one request handed straight to an ASGI app (no socket, no server)."""
    import asyncio

    raw = b"" if body is None else json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "server": ("127.0.0.1", 80),
        "client": ("127.0.0.1", 1),
        "state": {},
        "headers": [
            (k.lower().encode(), v.encode())
            for k, v in {"content-type": "application/json", "content-length": str(len(raw)), **(headers or {})}.items()
        ],
    }
    sent, messages = [], []

    async def receive():
        if not sent:
            sent.append(True)
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.Event().wait()  # the client stays

    async def send(message):
        messages.append(message)

    asyncio.run(app(scope, receive, send))
    start = messages[0]
    return (
        start["status"],
        {k.decode().lower(): v.decode() for k, v in start.get("headers", [])},
        b"".join(m.get("body", b"") for m in messages[1:]),
    )
