"""Helpers of the serving tests (conftest.py puts this folder on sys.path)."""

import contextlib
import time

import pytest

from serving.grpc.client import Client


def assert_pages_free(engine):
    assert not engine.has_unfinished()
    assert engine.kv_cache.num_free_pages == engine.kv_cache.num_usable_pages, "KV pages leaked"


def wait_for(predicate, timeout=10.0, interval=0.02):
    """Polls predicate() until it is truthy (returns it) or the timeout passes (fails)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"condition not met within {timeout} s")


@contextlib.contextmanager
def client_of(server, **kwargs):
    with Client(server.address, **kwargs) as client:
        yield client


@contextlib.contextmanager
def slow_steps(engine, seconds):
    """Makes every engine step take at least `seconds` (so a request is surely in flight)."""
    original = engine.step

    def step():
        time.sleep(seconds)
        return original()

    engine.step = step
    try:
        yield
    finally:
        del engine.step
