"""Per-request limits through the engine: max_n, max_request_tokens, and a large-n request that
takes turns with a small one (bounded in engine steps, not seconds); aborting it frees everything."""

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
        num_pages=96,
        page_size=16,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        max_model_len=256,
        token_buckets=(8, 32),
        max_n=16,
        max_seqs_per_request=4,
        max_request_tokens=128,
    )
    return Engine(model, config)


def assert_idle(engine):
    assert not engine.has_unfinished()
    assert engine.kv_cache.num_free_pages == engine.kv_cache.num_usable_pages
    assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0


def drain(engine):
    while engine.has_unfinished():
        engine.step()


def test_limits_name_the_field_and_the_limit(engine):
    with pytest.raises(ValueError, match=r"SamplingParams.n=17: exceeds this engine's max_n=16"):
        engine.add_request([1, 2, 3], SamplingParams(n=17))
    with pytest.raises(ValueError, match=r"max_tokens=126: exceeds this engine's max_request_tokens=128"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=126))
    assert_idle(engine)


def test_a_small_request_finishes_promptly_beside_one_at_the_n_limit(engine):
    big = SamplingParams(n=16, max_tokens=40, temperature=0, ignore_eos=True)
    engine.add_request([5, 6, 7, 8, 9], big, request_id="big")
    engine.step()  # the big request's parent computes the prompt; its siblings may enter now
    engine.add_request([11, 12, 13], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), request_id="small")
    for steps in range(1, 11):  # noqa: B007 - read after the loop
        if any(out.request_id == "small" and out.finished for out in engine.step()):
            break
    else:
        raise AssertionError("the small request was still running after 10 steps")
    assert steps <= 6
    engine.abort("big")
    outs = engine.step()
    assert [o.request_id for o in outs] == ["big"] and outs[0].finished
    assert {c.finish_reason for c in outs[0].outputs} == {"abort"}
    assert_idle(engine)


def test_every_sample_of_a_large_n_request_completes(engine):
    params = SamplingParams(n=16, max_tokens=5, temperature=1.0, seed=3, ignore_eos=True)
    engine.add_request([1, 2, 3, 4], params, request_id="all")
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            for c in out.outputs:
                outputs.setdefault(c.index, []).extend(c.token_ids)
    assert sorted(outputs) == list(range(16)) and all(len(t) == 5 for t in outputs.values())
    assert_idle(engine)
