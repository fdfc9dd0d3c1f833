"""Admission of large-n requests: siblings take turns with other requests, the queue stays
bounded, and aborting or finishing costs O(the request's samples) (counted, not timed)."""

import sys

from jaxinfer.core import admission, scheduler
from jaxinfer.core.scheduler import Scheduler
from jaxinfer.kv import KVCacheManager
from jaxinfer.sampling import SamplingParams

TOKEN = 1000


def make(window=None, *, num_pages=512, max_num_seqs=8):
    return Scheduler(
        KVCacheManager(num_pages, 4),
        max_num_batched_tokens=64,
        max_num_seqs=max_num_seqs,
        max_model_len=256,
        max_seqs_per_request=window,
    )


def run_step(sched):
    plan = sched.schedule()
    sched.update(plan, [TOKEN] * len(plan.seqs))
    return plan


def steps_until_done(sched, request_id, limit=1000):
    for n in range(1, limit + 1):
        run_step(sched)
        if request_id not in sched.requests:
            return n
    raise AssertionError(f"{request_id} not done after {limit} steps")


def drain(sched):
    while sched.has_unfinished():
        run_step(sched)
    assert sched.kv_cache.num_free_pages == sched.kv_cache.num_usable_pages and not sched.requests


def test_a_small_request_is_not_stuck_behind_a_large_n():
    big = SamplingParams(n=64, max_tokens=16)
    small = SamplingParams(max_tokens=4)
    results = {}
    for window in (None, 4):
        sched = make(window)
        sched.add_request("big", [1, 2, 3, 4, 5], big)
        run_step(sched)  # the parent computes the prompt: its siblings may enter now
        sched.add_request("small", [7, 8, 9], small)
        results[window] = steps_until_done(sched, "small")
        drain(sched)
    # Without a window the 63 siblings queue ahead of it (8 run at a time, 16 tokens each).
    assert results[None] > 50
    assert results[4] <= 6


def test_the_queue_holds_at_most_a_window_of_one_request():
    sched = make(window=3, max_num_seqs=4)
    seqs = sched.add_request("big", [1, 2, 3], SamplingParams(n=40, max_tokens=3))
    assert sched.num_waiting == 40 and len(sched.waiting) == 1  # siblings wait for the parent
    while sched.has_unfinished():
        run_step(sched)
        active = [s for s in seqs if s in sched.waiting or s in sched.running]
        assert len(active) <= 3
    assert all(s.num_output_tokens == 3 for s in seqs)
    assert sched.kv_cache.num_free_pages == sched.kv_cache.num_usable_pages


def lines_executed(fn):
    """Python lines run inside the scheduler's modules while `fn` runs: a cost counter."""
    watched = {scheduler.__file__, admission.__file__}
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if frame.f_code.co_filename not in watched:
            return None
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def abort_cost(n, window):
    sched = make(window)
    sched.add_request("big", [1, 2, 3, 4, 5], SamplingParams(n=n, max_tokens=64))
    for _ in range(3):
        run_step(sched)
    cost = lines_executed(lambda: sched.abort("big"))
    assert not sched.has_unfinished() and not sched.requests
    assert sched.kv_cache.num_free_pages == sched.kv_cache.num_usable_pages
    return cost


def test_abort_costs_linear_in_the_samples():
    for window in (None, 8):
        small, large = abort_cost(500, window), abort_cost(4000, window)
        assert large < 10 * small  # 8x the samples: linear is ~8x, quadratic would be ~64x
        assert large < 40 * 4000
