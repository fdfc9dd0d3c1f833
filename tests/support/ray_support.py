"""A local Ray cluster for the Ray tests: `ray start --head` on free loopback ports (4 logical CPUs,
a metrics export port, no dashboard, token auth off for loopback), stopped with `ray stop` at the
end. The modules that start one run on one xdist worker, one after another (tests/conftest.py:
RAY_MODULES), so two clusters never share the machine."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

RAY = Path(sys.executable).with_name("ray")
ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "JAX_PLATFORMS": "cpu"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayCluster:
    def __init__(self, num_cpus: int = 4):
        os.environ.update(ENV)  # this process's drivers (ray.init) and the processes it starts
        self.port, self.metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        done = subprocess.run(
            [
                str(RAY),
                "start",
                "--head",
                f"--port={self.port}",
                "--node-ip-address=127.0.0.1",
                f"--num-cpus={num_cpus}",
                f"--metrics-export-port={self.metrics_port}",
                "--include-dashboard=false",
                "--disable-usage-stats",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            pytest.fail(f"ray start failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")

    def stop(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        subprocess.run([str(RAY), "stop", "--force"], capture_output=True, timeout=120)


def running_cluster():
    """A module's cluster fixture: `yield from running_cluster()`."""
    cluster = RayCluster()
    try:
        yield cluster
    finally:
        cluster.stop()


def replica_pids(pattern: str) -> list[int]:
    """Processes whose command line (Ray's process title) matches `pattern`, e.g. a Ray Data
    actor's "MapBatches(RowReplica)"."""
    done = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split()]
