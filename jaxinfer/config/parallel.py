"""ParallelConfig: the device mesh an engine spreads over, and the hosts of a multi-host run."""

from __future__ import annotations

import dataclasses

from jaxinfer.config.checks import bools
from jaxinfer.options import DISABLE, option


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """`mesh` ("data=2,tensor=4", a dict of axis sizes, or a jax Mesh from sharding.make_mesh)
    spreads the engine over devices; with data=N there are N replicas, each with its own
    scheduler and KV pool. On several hosts every process runs the same program with the
    coordinator's address, the number of processes and its own index (or the JAXINFER_*
    environment variables; "auto" on TPU pods); process 0 schedules."""

    TITLE = "devices and hosts"

    mesh: str | dict | object | None = option(
        None,
        "device mesh, e.g. tensor=4, data=2,tensor=4 or stage=2,tensor=4 (axes: data, stage, sequence, "
        "expert, tensor); default: one device",
    )
    # With stage=N: N batches in flight, one on each stage (worker/pipelined.py); False: one
    # batch goes through the stages at a time while the others wait.
    pipeline_batches: bool = option(
        True,
        "with stage=N, take one batch at a time through the pipeline stages instead of N in flight",
        form=DISABLE,
        flag="--no-pipeline-batches",
    )
    coordinator_address: str | None = option(
        None, "HOST:PORT of process 0 for multi-host runs ('auto' on TPU pods); env JAXINFER_COORDINATOR_ADDRESS"
    )
    num_processes: int | None = option(None, "processes in a multi-host run")
    process_id: int | None = option(None, "this process's index (0 schedules)")

    def __post_init__(self):
        bools(self, "pipeline_batches")
        if isinstance(self.mesh, (str, dict)):
            from sharding.mesh import format_mesh, parse_mesh_spec  # imports jax: only when asked for

            object.__setattr__(self, "mesh", format_mesh(parse_mesh_spec(self.mesh)))
        for name in ("num_processes", "process_id"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"EngineConfig.{name} must be an integer >= 0, got {value!r}")
