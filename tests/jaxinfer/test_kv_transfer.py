"""KV pages pulled from one engine's pool into another's over jax.experimental.transfer (two
transfer servers on loopback): the pulled pages are the source's bytes, written where the sink
asked, padding pages never written over a real one; the layouts two pools compare; nothing
compiles after warm_up."""

import jax
import numpy as np
import pytest
from engine_runs import run_requests
from testpaths import FIXTURES

from jaxinfer.config import EngineConfig
from jaxinfer.engine import Engine
from jaxinfer.loader import load_model
from jaxinfer.quant.kv_cache import kv_pages
from jaxinfer.sampling import SamplingParams
from jaxinfer.worker.kv_transfer import KVTransfer, split_widths

CONFIG = dict(
    max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, token_buckets=(16,), page_size=4, num_pages=16
)


@pytest.fixture(scope="module")
def model():
    return load_model(FIXTURES / "hf" / "llama3", dtype="float32", with_tokenizer=False)


@pytest.fixture(scope="module")
def engines(model):
    """Two engines of one layout (the source's pool written by a prompt), and one of another."""
    source, sink = (Engine(model, EngineConfig(**CONFIG, penalties=False), warm_up=False) for _ in range(2))
    run_requests(source, [(list(range(1, 20)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))])
    other = Engine(model, EngineConfig(**{**CONFIG, "page_size": 8}, penalties=False), warm_up=False)
    return source, sink, other


def _pages(engine, ids):
    return [np.asarray(kv_pages(c))[ids] for c in engine.worker.state.kv_caches]


def test_pulled_pages_are_the_sources_bytes(engines):
    source, sink, _ = engines
    give, take = KVTransfer(source.worker.state), KVTransfer(sink.worker.state)
    take.warm_up()
    compiled = take._gather._cache_size() + take._scatter._cache_size()
    pages = [1, 2, 3, 4, 5]  # the prompt's pages (written): one call of width 16
    assert split_widths(5) == [16] and split_widths(64) == [64] and split_widths(70) == [64, 16]
    held = give.offer([11], pages)
    before = _pages(sink, [0, 9])
    take.write([list(jax.block_until_ready(a)) for a in take.fetch(give.address, [11], [16])], [12, 3, 7, 9, 10])
    for want, got in zip(_pages(source, pages), _pages(sink, [12, 3, 7, 9, 10])):
        np.testing.assert_array_equal(got, want)
        assert np.abs(want).sum() > 0  # real KV, not zeros
    np.testing.assert_array_equal(_pages(sink, [0])[0], before[0][:1])  # the null page: padding only
    assert take._gather._cache_size() + take._scatter._cache_size() == compiled
    del held


def test_a_pool_of_another_layout_is_not_pulled_from(engines):
    source, _, other = engines
    give, take = KVTransfer(source.worker.state), KVTransfer(other.worker.state)
    assert give.layout() != take.layout() and give.layout()[0]["page"][0] == 4 and take.layout()[0]["page"][0] == 8
    with pytest.raises(ValueError, match="2 transfer ids for 1 calls"):
        give.offer([1, 2], [1])
