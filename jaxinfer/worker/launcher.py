"""Launching the step from a thread of its own (EngineConfig.dispatch_thread).

Calling a jitted step on XLA:GPU launches its kernels from the calling thread, and each
conditional in it (the sampler's, sampling/sampler.py) copies its predicate to the host and holds
that thread until the device has reached it. Called from the engine's loop, the call returns only
when the device has nearly run the step, so the host plans and builds the next step while the
device idles, which async scheduling was meant to avoid. With a launcher thread the loop hands
the launch over and goes on planning; the thread launches the steps in the order given, so each
step still follows the one before on the device, and a step's outputs are waited for where they
are fetched (`landed`).

    launcher = Launcher(enabled=True)
    out = launcher.submit(fn, *args)   # a Future of fn's result (or the result, when disabled)
    landed(out)                        # the result, once the launch has returned

On the CPU the step's operations run on XLA's own threads and a call returns at once, and a TPU
runs a step's conditionals without the host, so the launcher is on by default on GPUs only
(dispatch_thread_enabled).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax

from sharding import is_multiprocess


def dispatch_thread_enabled(setting: bool | None) -> bool:
    """The setting (EngineConfig.dispatch_thread); by default on GPUs only (XLA:CPU and XLA:TPU
    return from a call without waiting on its conditionals). Never with
    several hosts, whose followers launch the same steps in lockstep from their own loops (data
    replicas run in the one jitted call, and launch from the thread like one)."""
    if is_multiprocess():
        return False
    return jax.default_backend() == "gpu" if setting is None else setting


class Launcher:
    """Runs the functions given to `submit` one after another, on one thread of its own when
    enabled, else at once on the caller's."""

    def __init__(self, enabled: bool):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="jaxinfer-launch") if enabled else None

    @property
    def enabled(self) -> bool:
        return self._pool is not None

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args): a Future of its result on the launcher's thread, or the result itself."""
        return fn(*args) if self._pool is None else self._pool.submit(fn, *args)


def landed(out: Any) -> Any:
    """What a launch returned: `out` itself, or its Future's result (re-raising its error)."""
    return out.result() if isinstance(out, Future) else out
