"""The launcher (EngineConfig.dispatch_thread): steps launched from a thread of their own, in the
order given, their results and errors reaching whoever lands them; it and the greedy twin are on
by default where XLA holds the launching thread on conditionals (GPUs)."""

import threading
import time

import jax
import pytest

from jaxinfer.worker.launcher import Launcher, dispatch_thread_enabled, landed
from jaxinfer.worker.step_variants import greedy_variant_enabled


def test_launches_run_in_order_on_one_thread_and_the_caller_goes_on():
    launcher, ran = Launcher(enabled=True), []

    def launch(i):
        time.sleep(0.05 if i == 0 else 0)  # the first holds its thread, as a conditional would
        ran.append((i, threading.current_thread().name))
        return i * 10

    start = time.perf_counter()
    futures = [launcher.submit(launch, i) for i in range(4)]
    assert time.perf_counter() - start < 0.04  # handed over, not waited for
    assert [landed(f) for f in futures] == [0, 10, 20, 30]
    assert [i for i, _ in ran] == [0, 1, 2, 3]
    assert {name for _, name in ran} == {ran[0][1]} and ran[0][1].startswith("jaxinfer-launch")


def test_a_launch_error_reaches_the_landing_and_later_launches_still_run():
    launcher = Launcher(enabled=True)
    failed = launcher.submit(lambda: 1 / 0)
    after = launcher.submit(lambda: "next")
    with pytest.raises(ZeroDivisionError):
        landed(failed)
    assert landed(after) == "next"


def test_disabled_runs_at_once_on_the_caller():
    launcher = Launcher(enabled=False)
    assert not launcher.enabled
    assert launcher.submit(threading.current_thread) is threading.current_thread()
    assert landed(5) == 5


def test_on_gpus_by_default(monkeypatch):
    """Only XLA:GPU holds the launching thread on a step's conditionals; the setting wins."""
    assert dispatch_thread_enabled(None) is False  # the CPU: a call returns at once already
    assert dispatch_thread_enabled(True) is True and dispatch_thread_enabled(False) is False
    for backend, default in (("gpu", True), ("tpu", False)):
        monkeypatch.setattr(jax, "default_backend", lambda backend=backend: backend)
        assert dispatch_thread_enabled(None) is default and dispatch_thread_enabled(not default) is not default
        assert greedy_variant_enabled(None) is default and greedy_variant_enabled(None, num_replicas=2) is False
