"""The prefix cache's host tier on the engine (`kv_offload_gb`): prompts whose cached pages do not
all fit the device pool are served on a second pass from pages kept in host memory (hit counts by
tier asserted, per request and in all), with the tokens of an engine without the tier; nothing
compiles after warm-up; every page free at the end; a tier smaller than one page is refused;
preempted sequences swap their pages out and back where that is cheaper."""

import numpy as np
import pytest
from engine_runs import run_requests
from testpaths import FIXTURES

from jaxinfer.config import EngineConfig
from jaxinfer.engine import Engine
from jaxinfer.loader import load_model
from jaxinfer.sampling import SamplingParams

PAGE = 4
SMALL = dict(
    max_model_len=128,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    token_buckets=(8, 32),
    page_size=PAGE,
    num_pages=33,  # 32 usable: 10 prompts of 8 full pages each cannot all stay cached
    penalties=False,
)
PROMPTS = [np.random.default_rng(i).integers(1, 250, 33).tolist() for i in range(10)]


def _run(engine, prompts=PROMPTS, max_tokens=6):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return run_requests(engine, [(p, params) for p in prompts])


@pytest.fixture(scope="module")
def model():
    return load_model(FIXTURES / "hf" / "llama3", dtype="float32", with_tokenizer=False)


def test_a_second_pass_is_served_from_host_pages(model):
    want = [o.outputs[0].token_ids for o in _run(Engine(model, EngineConfig(**SMALL)))]
    engine = Engine(model, EngineConfig(**SMALL, kv_offload_gb=0.0004))  # 209 pages of 2 KiB
    kv, compiled = engine.kv_cache, engine.worker.num_compiled()
    assert engine.worker.host_pages == 209 and kv.host is not None
    first = _run(engine)
    assert [o.outputs[0].token_ids for o in first] == want
    hits, host_hits = kv.pool.prefix_cache_hits, kv.pool.prefix_cache_host_hits
    second = _run(engine)
    assert [o.outputs[0].token_ids for o in second] == want
    full = (len(PROMPTS[0]) - 1) // PAGE * PAGE  # every full page but the last token's
    assert [o.usage.cached_prompt_tokens for o in second] == [full] * len(PROMPTS)
    assert kv.pool.prefix_cache_hits - hits == full * len(PROMPTS)
    from_host = kv.pool.prefix_cache_host_hits - host_hits
    assert from_host >= full * (len(PROMPTS) - 4)  # the device keeps the pages of 4 prompts at most
    assert sum(o.usage.host_cached_prompt_tokens for o in second) == from_host
    stats = engine.stats()
    assert stats["kv_host_pages_total"] == 209 and 0 < stats["kv_host_pages_used"] <= 209
    assert stats["prefix_cache_host_hits"] == kv.pool.prefix_cache_host_hits
    assert kv.host.num_loaded > 0 and kv.num_free_pages == kv.num_usable_pages
    assert engine.worker.num_compiled() == compiled


def test_a_tier_smaller_than_a_page_is_refused(model):
    with pytest.raises(ValueError, match="kv_offload_gb=1e-07: less than one KV page of 2048 bytes"):
        Engine(model, EngineConfig(**SMALL, kv_offload_gb=1e-7))


def test_preempted_sequences_come_back_from_host_pages(model):
    """Sequences that outgrow the pool are preempted; their computed pages, cached, are evicted to
    the host tier by the others and loaded back when they return: the tokens of recomputing."""
    prompts = [np.random.default_rng(100 + i).integers(1, 250, 9).tolist() for i in range(4)]

    def run(engine):  # 9 + 50 tokens: 15 pages each, 4 at once in 32
        return [o.outputs[0].token_ids for o in _run(engine, prompts, max_tokens=50)]

    plain = Engine(model, EngineConfig(**SMALL))
    want = run(plain)
    engine = Engine(model, EngineConfig(**SMALL, kv_offload_gb=0.0004))
    engine.kv_cache.swap_cost.token_s = 0.0  # the cache's path alone: no swap
    assert run(engine) == want
    assert engine.num_preemptions > 0 and plain.num_preemptions == engine.num_preemptions
    assert engine.kv_cache.pool.prefix_cache_host_hits > 0  # came back from host pages, not recomputed
    assert engine.kv_cache.num_free_pages == engine.kv_cache.num_usable_pages
    assert engine.kv_cache.num_swapped_preemptions == 0


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
def test_preemption_swaps_pages_out_and_back(model, caching):
    """Where the measured cost model prices it below recomputing, a preempted sequence's pages
    the prefix cache does not keep (the partial last one; every one without prefix caching) are
    swapped to host slots and loaded back at its return: the tokens of recomputing, fewer tokens
    computed, every page of both tiers free at the end, nothing compiled after warm-up."""
    prompts = [np.random.default_rng(100 + i).integers(1, 250, 9).tolist() for i in range(4)]
    config = dict(SMALL, enable_prefix_caching=caching)
    plain = Engine(model, EngineConfig(**config))
    want = [o.outputs[0].token_ids for o in _run(plain, prompts, max_tokens=50)]
    engine = Engine(model, EngineConfig(**config, kv_offload_gb=0.0004))
    kv, compiled, cost = engine.kv_cache, engine.worker.num_compiled(), engine.kv_cache.swap_cost
    assert cost is engine.worker.swap_cost and cost.transfer_s > 0 and cost.token_s > 0  # measured
    cost.token_s = 1.0  # swapping always wins here, whatever this machine measured
    assert [o.outputs[0].token_ids for o in _run(engine, prompts, max_tokens=50)] == want
    assert engine.num_preemptions > 0 and plain.num_preemptions > 0  # (swaps change the schedule)
    assert 0 < kv.num_swapped_preemptions <= engine.num_preemptions and kv.host.num_swapped_out > 0  # none: all cached
    assert engine.num_scheduled_tokens < plain.num_scheduled_tokens  # swapped tokens not recomputed
    assert kv.num_free_pages == kv.num_usable_pages and kv.host.num_swapped == 0
    assert engine.worker.num_compiled() == compiled
