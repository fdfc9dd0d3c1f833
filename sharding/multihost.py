"""Several hosts, one engine: start-up, and keeping every process on the same step.

Start-up: `initialize(coordinator_address, num_processes, process_id)` calls
`jax.distributed.initialize` from those arguments or, where they are not given, from the
environment (JAXINFER_COORDINATOR_ADDRESS / _NUM_PROCESSES / _PROCESS_ID). The address "auto"
lets JAX detect the cluster itself (TPU VM pods, SLURM). Nothing given: a single process.

Lock step: the model step is one SPMD program over every device of every host, so all processes
must call it in the same order with the same inputs. Only process 0 runs the scheduler. For each
step it broadcasts a small header (what to run, the token bucket, whether a penalty history is
attached) and then the padded numpy step inputs; the other processes build an all-padding
template of that bucket, receive the inputs into it and run the same step. RELEASE ends one
`follow()` of the others (process 0 sends it when a `generate` call of its own is done, so the
same script can run on every host); SHUTDOWN tells them no more steps will come (the CLI).
TRANSFER carries one call of the KV cache's host tier (its page and slot ids), which every
process makes on its own shards of the pages (jaxinfer/worker/kv_host.py).

    process 0:   header, inputs -> StepChannel.send(...) -> run step -> scheduler.update(...)
    process k:   StepChannel.receive(template_for) -> run step -> (tokens are ignored)
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

logger = logging.getLogger(__name__)

STEP, RELEASE, SHUTDOWN, TRANSFER = 1, 2, 3, 4
ENV_PREFIX = "JAXINFER_"

# A pytree of arrays (a step's inputs or outputs); JAX has no static type for one.
PyTree = Any


@dataclasses.dataclass(frozen=True)
class DistributedArgs:
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    @classmethod
    def from_env(
        cls,
        coordinator_address: str | None = None,
        num_processes: int | None = None,
        process_id: int | None = None,
        env: Mapping[str, str] | None = None,
    ) -> DistributedArgs:
        """Arguments win over JAXINFER_* environment variables."""
        environ = os.environ if env is None else env

        def pick[T: (str, int)](value: T | None, name: str, kind: type[T]) -> T | None:
            raw = value if value is not None else environ.get(ENV_PREFIX + name)
            if raw is None or raw == "":
                return None
            try:
                return kind(raw)
            except ValueError:
                raise ValueError(f"{name.lower()}={raw!r} must be {kind.__name__}") from None

        return cls(
            pick(coordinator_address, "COORDINATOR_ADDRESS", str),
            pick(num_processes, "NUM_PROCESSES", int),
            pick(process_id, "PROCESS_ID", int),
        )


def initialize(
    coordinator_address: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> bool:
    """Joins the cluster if asked to; returns True when running with jax.distributed.

    Must run before anything touches a device (before loading a model)."""
    args = DistributedArgs.from_env(coordinator_address, num_processes, process_id)
    if args.coordinator_address is None:
        if args.num_processes not in (None, 1) or args.process_id not in (None, 0):
            raise ValueError(
                "num_processes / process_id need a coordinator address "
                "(--coordinator-address HOST:PORT, or 'auto' on a TPU pod)"
            )
        return False
    if jax.distributed.is_initialized():
        return True
    if args.coordinator_address == "auto":
        jax.distributed.initialize()
    else:
        if args.num_processes is None or args.process_id is None:
            raise ValueError(f"coordinator address {args.coordinator_address!r} needs --num-processes and --process-id")
        if not 0 <= args.process_id < args.num_processes:
            raise ValueError(f"process_id={args.process_id} must be in [0, {args.num_processes})")
        jax.distributed.initialize(
            args.coordinator_address, num_processes=args.num_processes, process_id=args.process_id
        )
    logger.info(
        "process %d of %d; %d local of %d devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
    return True


def is_leader() -> bool:
    return jax.process_index() == 0


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def broadcast(tree: PyTree) -> PyTree:
    """Process 0's value of a tree of numpy arrays, on every process (same structure needed)."""
    from jax.experimental import multihost_utils

    out = multihost_utils.broadcast_one_to_all(tree)
    return jax.tree.map(np.asarray, out)


def broadcast_int(value: int) -> int:
    if not is_multiprocess():
        return int(value)
    return int(broadcast(np.asarray(value, np.int64)))


class StepChannel:
    """Process 0 sends each step's inputs; the others receive them (see the module docstring)."""

    def send(
        self, inputs: PyTree, token_bucket: int, with_history: bool, prompt: bool = False, table_width: int = 0
    ) -> PyTree:
        """Process 0: broadcasts one step's header (its bucket and variant: a penalty history,
        prompt rows to score, how many page-table entries it sets), then its inputs; returns
        them as broadcast."""
        broadcast(np.array([STEP, token_bucket, int(with_history), int(prompt), table_width], np.int64))
        return broadcast(inputs)

    def release(self, shutdown: bool = False) -> None:
        broadcast(np.array([SHUTDOWN if shutdown else RELEASE, 0, 0, 0, 0], np.int64))

    def send_transfer(self, kind: int, ids: np.ndarray) -> None:
        """Process 0: one call of the KV host tier (its kind and page / slot ids, a fixed shape)."""
        broadcast(np.array([TRANSFER, kind, 0, 0, 0], np.int64))
        broadcast(ids)

    def receive(
        self, template_for: Callable[[int, bool, bool, int], PyTree], transfer_ids: np.ndarray | None = None
    ) -> tuple[int, PyTree | None]:
        """(command, inputs): (STEP, the next step's inputs), (TRANSFER, (kind, ids)), (RELEASE,
        None) or (SHUTDOWN, None). template_for(bucket, with_history, prompt, table_width) builds
        an input tree of the right shapes; `transfer_ids` is the host tier's id array template."""
        command, token_bucket, with_history, prompt, table_width = broadcast(np.zeros(5, np.int64)).tolist()
        if command in (RELEASE, SHUTDOWN):
            return command, None
        if command == TRANSFER:
            if transfer_ids is None:
                raise RuntimeError("process 0 sent a KV host-tier transfer, but this process has no host tier")
            return TRANSFER, (int(token_bucket), broadcast(transfer_ids))
        if command != STEP:
            raise RuntimeError(f"unknown step command {command} from process 0")
        return STEP, broadcast(template_for(int(token_bucket), bool(with_history), bool(prompt), int(table_width)))


def put_inputs(tree: PyTree, shardings: PyTree) -> PyTree:
    """Host numpy (the same value on every process) -> jax.Arrays placed with these shardings
    (a tree like `tree`). On several processes each one fills only its own devices."""
    if not is_multiprocess():
        return jax.device_put(tree, shardings)
    from sharding.placement import put_sharded

    return jax.tree.map(lambda x, s: put_sharded(np.asarray(x), s), tree, shardings)


def fetch(tree: PyTree) -> PyTree:
    """Device outputs -> numpy. Outputs are replicated, so each process reads a local copy."""
    if not is_multiprocess():
        return jax.device_get(tree)
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)
