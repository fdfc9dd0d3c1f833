"""The engine end to end on a tiny random Llama (token-id prompts): HF parity under chunked
prefill and preemption, no recompilation, prefix caching, seeded sampling, aborts, bad input."""

import json

import jax
import numpy as np
import pytest
from testpaths import FIXTURES

from jaxinfer.config import EngineConfig
from jaxinfer.engine import Engine
from jaxinfer.loader import load_model
from jaxinfer.sampling import SamplingParams

GOLDEN = json.loads((FIXTURES / "hf" / "llama3" / "generate.json").read_text())
GREEDY = SamplingParams(temperature=0, max_tokens=GOLDEN["max_new_tokens"], ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return load_model(FIXTURES / "hf" / "llama3", dtype="float32")


def make_engine(model, **overrides):
    cfg = dict(
        num_pages=24, page_size=16, max_num_batched_tokens=32, max_num_seqs=8, max_model_len=256, token_buckets=(8, 32)
    )
    cfg.update(overrides)
    return Engine(model, EngineConfig(**cfg))


def run_all(engine) -> dict:
    """Steps until idle; request id -> accumulated RequestOutput."""
    results = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.request_id in results:
                results[delta.request_id].merge(delta)
            else:
                results[delta.request_id] = delta
    assert_pool_empty(engine)
    return results


def assert_pool_empty(engine):
    kv_cache = engine.kv_cache
    assert kv_cache.num_free_pages == kv_cache.num_usable_pages, "pages leaked"
    assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0


@pytest.fixture(scope="module")
def engine(model):
    return make_engine(model)


def test_greedy_batch_matches_hf_with_chunking_and_preemption(engine):
    preemptions_before = engine.num_preemptions
    for i, prompt in enumerate(GOLDEN["prompts"]):
        engine.add_request(prompt, GREEDY, request_id=f"g{i}")
    results = run_all(engine)
    for i, expected in enumerate(GOLDEN["outputs"]):
        out = results[f"g{i}"]
        assert out.outputs[0].token_ids == expected, f"prompt {i}"
        assert out.outputs[0].finish_reason == "length" and out.finished
        assert out.usage.completion_tokens == len(expected)
    # The 24-page pool cannot hold all 16 sequences: the run must have preempted.
    assert engine.num_preemptions > preemptions_before


def test_nothing_compiles_after_warm_up(engine):
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: compiles.append(name) if "compile" in name else None
    )
    variants = engine.worker.num_compiled()
    rng = np.random.default_rng(0)
    params = [
        GREEDY,
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1, max_tokens=9),
        SamplingParams(temperature=1.0, min_p=0.1, seed=2, max_tokens=5, logprobs=3),
        SamplingParams(
            temperature=0.7,
            repetition_penalty=1.2,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            seed=3,
            max_tokens=7,
            n=2,
        ),
        SamplingParams(temperature=0, max_tokens=3, stop_token_ids=[5]),
        SamplingParams(temperature=0.9, seed=4, max_tokens=6, logit_bias={5: 3.0, 11: -100.0}),
    ]
    for i in range(12):
        prompt = rng.integers(0, 512, size=int(rng.integers(1, 90))).tolist()
        engine.add_request(prompt, params[i % len(params)])
    run_all(engine)
    assert engine.worker.num_compiled() == variants
    assert [c for c in compiles if "backend_compile" in c] == []


def test_prefix_cache_computes_only_new_tokens(model):
    prefix = list(range(100, 164))  # 64 tokens = 4 full pages
    first, second = prefix + [7, 8, 9], prefix + [10, 11, 12, 13, 14]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cached = make_engine(model, num_pages=64, num_decode_steps=1)  # one token a step
    cached.add_request(first, params, request_id="a")
    run_all(cached)
    before = cached.num_scheduled_tokens
    cached.add_request(second, params, request_id="b")
    out_cached = run_all(cached)["b"]
    # 4 cached pages: only the 5 new prompt tokens, then 5 decode steps of one token each.
    assert cached.num_scheduled_tokens - before == len(second) - 64 + 5
    assert out_cached.usage.cached_prompt_tokens == 64
    plain = make_engine(model, num_pages=64, enable_prefix_caching=False)
    plain.add_request(second, params, request_id="b")
    out_plain = run_all(plain)["b"]
    assert out_plain.usage.cached_prompt_tokens == 0
    assert out_cached.outputs[0].token_ids == out_plain.outputs[0].token_ids


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    prompt = GOLDEN["prompts"][5]
    engine.add_request(prompt, params, request_id="alone")
    alone = run_all(engine)["alone"].outputs[0].token_ids
    for i, other in enumerate(GOLDEN["prompts"][:6]):
        engine.add_request(other, SamplingParams(temperature=0.9, seed=i, max_tokens=10), request_id=f"o{i}")
    engine.add_request(prompt, params, request_id="crowd")
    crowd = run_all(engine)["crowd"].outputs[0].token_ids
    assert alone == crowd
    engine.add_request(
        prompt,
        SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=12, ignore_eos=True),
        request_id="other-seed",
    )
    assert run_all(engine)["other-seed"].outputs[0].token_ids != alone


def test_parallel_samples_and_logprobs(engine):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, logprobs=4, ignore_eos=True)
    engine.add_request(GOLDEN["prompts"][9], params, request_id="n3")
    out = run_all(engine)["n3"]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert len(c.token_ids) == 6 and len(c.logprobs) == 6
        for tok, lp in zip(c.token_ids, c.logprobs):
            assert lp.token_id == tok and lp.logprob <= 0 and len(lp.top) == 4
            if tok in lp.top:
                assert lp.top[tok] == pytest.approx(lp.logprob, abs=1e-5)
    assert out.usage.completion_tokens == 18


def test_abort_frees_pages_and_reports(engine):
    engine.add_request(GOLDEN["prompts"][-1], SamplingParams(temperature=0, max_tokens=100), request_id="x")
    engine.add_request(GOLDEN["prompts"][3], GREEDY, request_id="y")
    engine.step()
    engine.step()
    assert engine.abort("x") and not engine.abort("never-existed")
    results = run_all(engine)
    assert results["x"].outputs[0].finish_reason == "abort" and results["x"].finished
    assert results["y"].outputs[0].token_ids == GOLDEN["outputs"][3]


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ([], GREEDY, "empty"),
        ([1] * 300, GREEDY, "context of 256"),
        ([1, 2, 512], GREEDY, r"out of range \[0, 512\): \[512\]"),
        ([1, 2], SamplingParams(max_tokens=255), "257 tokens exceeds max_model_len=256"),
        ("text prompt", GREEDY, "no tokenizer"),
    ],
)
def test_bad_requests_are_rejected_and_engine_keeps_serving(engine, prompt, params, match):
    engine.add_request(GOLDEN["prompts"][2], GREEDY, request_id="ok")
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, params)
    assert run_all(engine)["ok"].outputs[0].token_ids == GOLDEN["outputs"][2]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
    ],
)
def test_bad_sampling_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_engine_config_errors(model):
    with pytest.raises(ValueError, match="max_model_len=999"):
        make_engine(model, max_model_len=999)
    with pytest.raises(ValueError, match="page_size"):
        EngineConfig(page_size=0)
    with pytest.raises(ValueError, match="token_buckets"):
        EngineConfig(token_buckets=(8, 16), max_num_batched_tokens=32)
    for bad, match in (
        (dict(attn_impl="flash"), "attn_impl='flash': expected one of"),
        (dict(kv_cache_dtype="int7"), "kv_cache_dtype='int7': expected one of"),
        (dict(max_n=0), "max_n must be a positive integer"),
        (dict(max_seqs_per_request=True), "max_seqs_per_request must be a positive integer"),
        (dict(max_request_tokens=-5), "max_request_tokens must be a positive integer"),
    ):
        with pytest.raises(ValueError, match=match):
            EngineConfig(**bad)
