"""vllm-router (the PyPI release, pip-installed by the test setup into a cache folder) started on
loopback in front of `jaxinfer serve` processes, for the router tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from openai_support import wait_for

ROUTER_VERSION = "0.1.17"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install_router() -> Path:
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
        self.port = free_port()
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
        return complete(self.url, prompt)

    def post(self, path: str, body: dict) -> dict:
        return post(self.url, path, body)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def complete(url: str, prompt: list[int], max_tokens: int = 8) -> dict:
    body = {"model": "llama3", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return post(url, "/v1/completions", body)


def post(url: str, path: str, body: dict) -> dict:
    """A JSON POST's JSON answer."""
    request = urllib.request.Request(f"{url}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())
