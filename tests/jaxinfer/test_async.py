"""Async scheduling (step N+1 planned and dispatched before step N's tokens reach the host) gives
exactly the synchronous engine's tokens: chunked prefill, preemption under a tiny pool, seeded
sampling, stop ids and max_tokens, n > 1, prefix-cache hits, penalties, aborts; every page free.
Single steps here (num_decode_steps=1); test_decode_window.py runs windows sync and async. Both
launch their steps from the launcher's thread (dispatch_thread), as on a GPU."""

import threading

import pytest
from testpaths import FIXTURES

from jaxinfer.config import EngineConfig
from jaxinfer.engine import Engine
from jaxinfer.loader import load_model
from jaxinfer.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine():
    model = load_model(FIXTURES / "hf" / "llama3", dtype="float32")
    config = EngineConfig(
        num_pages=14,
        page_size=8,
        max_num_batched_tokens=32,
        max_num_seqs=6,
        max_model_len=128,
        token_buckets=(8, 32),
        num_decode_steps=1,
        dispatch_thread=True,
    )
    return Engine(model, config)


def run(engine, requests, *, async_scheduling, abort_after=None):
    """requests: {id: (prompt ids, params)} -> ({id: [tokens per sample]}, {id: finish reasons})."""
    engine.config = engine.config.replace(async_scheduling=async_scheduling)
    for rid, (prompt, params) in requests.items():
        engine.add_request(prompt, params, request_id=rid)
    tokens, reasons, steps = {}, {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            per = tokens.setdefault(out.request_id, [[] for _ in out.outputs])
            for c in out.outputs:
                per[c.index] += c.token_ids
            if out.finished:
                reasons[out.request_id] = [c.finish_reason for c in out.outputs]
        steps += 1
        if abort_after and steps in abort_after:
            engine.abort(abort_after[steps])
    assert engine.kv_cache.num_free_pages == engine.kv_cache.num_usable_pages, "KV pages leaked"
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
    return tokens, reasons


def both(engine, requests, **kw):
    sync = run(engine, requests, async_scheduling=False, **kw)
    compiled = engine.worker.num_compiled()
    overlapped = run(engine, requests, async_scheduling=True, **kw)
    assert engine.worker.num_compiled() == compiled, "async scheduling compiled a new variant"
    return sync, overlapped


def prompt(seed, length):
    return [(seed * 37 + i * 11) % 250 + 1 for i in range(length)]


def test_greedy_with_chunked_prefill_and_preemption(engine, monkeypatch):
    filled_on_device = []  # input tokens per step taken from the step in flight
    dispatch = engine.worker.step.dispatch
    monkeypatch.setattr(
        engine.worker.step,
        "dispatch",
        lambda inputs, n=1: filled_on_device.append(int((inputs.prev_rows >= 0).sum())) or dispatch(inputs, n),
    )
    launched_on = set()
    launch = engine.worker.step._launch
    monkeypatch.setattr(
        engine.worker.step,
        "_launch",
        lambda fn, inputs: launched_on.add(threading.current_thread().name) or launch(fn, inputs),
    )
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    requests = {str(i): (prompt(i, 5 + 9 * i), greedy) for i in range(5)}  # 14 pages: preemptions
    before = engine.num_preemptions
    sync = run(engine, requests, async_scheduling=False)
    assert not any(filled_on_device)
    overlapped = run(engine, requests, async_scheduling=True)
    assert sum(filled_on_device) > 50  # most decode tokens came from the device, not the host
    assert len(launched_on) == 1 and next(iter(launched_on)).startswith("jaxinfer-launch")
    assert engine.num_preemptions > before
    assert sync == overlapped and all(len(t[0]) == 20 for t in sync[0].values())


def test_seeded_sampling_stops_n_and_penalties(engine):
    requests = {
        "seeded": (prompt(1, 12), SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=16)),
        "n3": (prompt(2, 9), SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)),
        "stop": (prompt(3, 7), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[])),
    }
    sync, _ = run(engine, {"stop": requests["stop"]}, async_scheduling=False)
    stop_id = sync["stop"][0][5]  # a token it emits mid-stream
    requests["stop"] = (
        prompt(3, 7),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id]),
    )
    requests["short"] = (prompt(4, 6), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    requests["penalty"] = (
        prompt(5, 8),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5),
    )
    sync, overlapped = both(engine, requests)
    assert sync == overlapped
    tokens, reasons = sync
    assert tokens["stop"][0][-1] == stop_id and reasons["stop"] == ["stop"]
    assert len(tokens["short"][0]) == 1 and [len(t) for t in tokens["n3"]] == [10, 10, 10]


def test_prefix_cache_hits_are_the_same(engine):
    shared = prompt(9, 40)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    requests = {"a": (shared, greedy), "b": (shared + [5, 6], greedy)}
    sync, overlapped = both(engine, requests)
    assert sync == overlapped


def test_aborts_mid_stream_free_everything(engine):
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    requests = {"kept": (prompt(6, 10), greedy), "dropped": (prompt(7, 10), greedy)}
    sync, overlapped = both(engine, requests, abort_after={4: "dropped"})
    assert sync[0]["kept"] == overlapped[0]["kept"]
    assert sync[1]["dropped"] == overlapped[1]["dropped"] == ["abort"]
    # Aborted streams only ever hold a prefix of what the request would have produced.
    full, _ = run(engine, {"dropped": (prompt(7, 10), greedy)}, async_scheduling=True)
    for got in (sync[0]["dropped"][0], overlapped[0]["dropped"][0]):
        assert got == full["dropped"][0][: len(got)]
