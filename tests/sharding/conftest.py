"""Runs tests/sharding/scenarios.py in fresh processes with forced CPU devices."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from xla_env import child_env

SCENARIOS = Path(__file__).resolve().parent / "scenarios.py"


def _env(devices: int) -> dict:
    return child_env(JAXINFER_TEST_DEVICES=str(devices))  # scenarios.py adds the device count


def _result(proc_stdout: str, stderr: str, args) -> dict:
    lines = [line for line in proc_stdout.splitlines() if line.startswith(("{", "["))]
    if not lines:
        raise AssertionError(f"scenario {args} printed no result; stderr tail:\n{stderr[-3000:]}")
    return json.loads(lines[-1])


def run_scenario(*args, devices: int = 8, timeout: float = 300) -> dict:
    proc = subprocess.run(
        [sys.executable, str(SCENARIOS), *args], capture_output=True, text=True, timeout=timeout, env=_env(devices)
    )
    if proc.returncode:
        raise AssertionError(f"scenario {args} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return _result(proc.stdout, proc.stderr, args)


def run_processes(arg_lists, devices: int, timeout: float = 300) -> list[dict]:
    """Starts one process per argument list at once; returns their results in order."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCENARIOS), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(devices),
        )
        for args in arg_lists
    ]
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=timeout))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    results = []
    for args, proc, (stdout, stderr) in zip(arg_lists, procs, outs):
        if proc.returncode:
            raise AssertionError(f"process {args} failed ({proc.returncode}):\n{stderr[-3000:]}")
        results.append(_result(stdout, stderr, args))
    return results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def scenario():
    return run_scenario


@pytest.fixture
def processes():
    return run_processes


@pytest.fixture
def port():
    return free_port()
