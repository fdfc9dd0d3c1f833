"""Speculative decoding end to end on the tiny random Llama: greedy outputs equal HF's goldens for
n-gram drafts and for draft models (itself: every draft accepted; another random checkpoint with
the same vocabulary), under chunked prefill and preemption, synchronous and async; seeded sampling,
n > 1, logprobs, stop ids inside an accepted run, max_tokens, prefix-cache hits, penalties beside
speculating rows and aborts give the tokens of plain decoding; on a tiny vocabulary a chi-square
test finds the sampled distributions equal; every page (target and draft) back in its pool and
nothing compiled after warm-up."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from scipy import stats
from testpaths import FIXTURES

from jaxinfer.config import EngineConfig
from jaxinfer.engine import Engine
from jaxinfer.loader import load_model
from jaxinfer.models.llama.model import init_params
from jaxinfer.sampling import SamplingParams

GOLDEN = json.loads((FIXTURES / "hf" / "llama3" / "generate.json").read_text())
GREEDY = SamplingParams(temperature=0, max_tokens=GOLDEN["max_new_tokens"], ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return load_model(FIXTURES / "hf" / "llama3", dtype="float32")


def make_engine(model, spec, **overrides):
    cfg = dict(
        num_pages=24,
        page_size=16,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        max_model_len=256,
        token_buckets=(32,),
        speculative_config=spec,
    )
    cfg.update(overrides)
    return Engine(model, EngineConfig(**cfg))


@pytest.fixture(scope="module")
def ngram(model):
    return make_engine(model, {"method": "ngram", "num_speculative_tokens": 3})


@pytest.fixture(scope="module")
def self_draft(model):
    spec = {"method": "draft_model", "model": str(FIXTURES / "hf" / "llama3"), "num_speculative_tokens": 3}
    return make_engine(model, spec)


def run(engine, requests, *, async_scheduling=True, abort_after=None):
    """requests: {id: (prompt, params)} -> {id: accumulated RequestOutput}; checks every page is
    back in the target's pool (and the draft model's)."""
    engine.config = engine.config.replace(async_scheduling=async_scheduling)
    for rid, (prompt, params) in requests.items():
        engine.add_request(prompt, params, request_id=rid)
    results, steps = {}, 0
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.request_id in results:
                results[delta.request_id].merge(delta)
            else:
                results[delta.request_id] = delta
        steps += 1
        if abort_after and steps in abort_after:
            engine.abort(abort_after[steps])
    assert engine.kv_cache.num_free_pages == engine.kv_cache.num_usable_pages, "KV pages leaked"
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
    proposer = engine.speculator.proposer
    if hasattr(proposer, "kv_cache"):
        engine.speculator.propose(engine.scheduler)  # releases what the finished sequences held
        assert proposer.kv_cache.num_free_pages == proposer.kv_cache.num_usable_pages, "draft KV pages leaked"
    return results


def tokens(results):
    return {rid: [c.token_ids for c in out.outputs] for rid, out in results.items()}


def golden_requests(params=GREEDY):
    return {f"g{i}": (prompt, params) for i, prompt in enumerate(GOLDEN["prompts"])}


def assert_golden(results):
    for i, expected in enumerate(GOLDEN["outputs"]):
        assert results[f"g{i}"].outputs[0].token_ids == expected, f"prompt {i}"


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_ngram_greedy_matches_hf_with_preemption(ngram, async_scheduling):
    compiled, preemptions = ngram.worker.num_compiled(), ngram.num_preemptions
    results = run(ngram, golden_requests(), async_scheduling=async_scheduling)
    assert_golden(results)
    assert ngram.num_preemptions > preemptions  # 24 pages cannot hold all 16 sequences
    drafted = sum(r.metrics.num_draft_tokens for r in results.values())
    accepted = sum(r.metrics.num_accepted_tokens for r in results.values())
    assert drafted > 100 and 0 < accepted < drafted
    assert ngram.worker.num_compiled() == compiled, "a step compiled after warm-up"
    stats_ = ngram.stats()
    assert stats_["spec_draft_tokens"] >= drafted and 0 < stats_["spec_acceptance_rate"] < 1


def test_draft_model_itself_accepts_every_draft(self_draft):
    compiled = self_draft.worker.num_compiled() + self_draft.speculator.proposer.worker.num_compiled()
    results = run(self_draft, golden_requests())
    assert_golden(results)
    for out in results.values():
        m = out.metrics
        assert m.num_draft_tokens > 0 and m.num_accepted_tokens == m.num_draft_tokens
        assert m.acceptance_rate == 1.0 and m.mean_accepted_length > 3
    assert self_draft.worker.num_compiled() + self_draft.speculator.proposer.worker.num_compiled() == compiled


def test_another_draft_checkpoint_keeps_the_goldens(model):
    spec = {"method": "draft_model", "model": str(FIXTURES / "hf" / "tied_gqa3"), "num_speculative_tokens": 3}
    engine = make_engine(model, spec)
    results = run(engine, golden_requests())
    assert_golden(results)
    assert engine.num_preemptions > 0
    assert sum(r.metrics.num_draft_tokens for r in results.values()) > 100


def prompt(seed, length):
    return [(seed * 37 + i * 11) % 250 + 1 for i in range(length)]


def compare_with_plain(engine, requests, **kw):
    """The same requests with speculation off per request, then on: identical outputs."""
    plain = {rid: (p, dataclasses.replace(params, speculative=False)) for rid, (p, params) in requests.items()}
    want = run(engine, plain, **kw)
    assert all(r.metrics.num_draft_tokens == 0 for r in want.values())
    got = run(engine, requests, **kw)
    assert tokens(got) == tokens(want)
    for rid in requests:
        for a, b in zip(got[rid].outputs, want[rid].outputs):
            assert (a.finish_reason, a.stop_reason) == (b.finish_reason, b.stop_reason), rid
            if b.logprobs is not None:
                assert [(lp.token_id, sorted(lp.top)) for lp in a.logprobs] == [
                    (lp.token_id, sorted(lp.top)) for lp in b.logprobs
                ]
                np.testing.assert_allclose(
                    [lp.logprob for lp in a.logprobs], [lp.logprob for lp in b.logprobs], atol=1e-4
                )
    return got


def test_sampling_n_logprobs_stops_and_prefix_hits_as_plain(self_draft):
    base = run(self_draft, {"s": (prompt(3, 7), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))})
    stop_id = base["s"].outputs[0].token_ids[5]  # the 6th token: inside the first accepted run
    shared = prompt(9, 40)
    requests = {
        "seeded": (prompt(1, 12), SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=17)),
        "n3": (prompt(2, 9), SamplingParams(n=3, temperature=0.6, seed=3, max_tokens=10, ignore_eos=True)),
        "stop": (prompt(3, 7), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id])),
        "logprobs": (prompt(4, 6), SamplingParams(temperature=0, max_tokens=9, logprobs=3, ignore_eos=True)),
        "odd": (prompt(5, 5), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)),
        "shared1": (shared, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
        "shared2": (shared + [5, 6], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
    }
    got = compare_with_plain(self_draft, requests)
    stop = got["stop"].outputs[0]
    assert stop.token_ids[-1] == stop_id and len(stop.token_ids) <= 6 and stop.finish_reason == "stop"
    assert [len(c.token_ids) for c in got["n3"].outputs] == [10, 10, 10]
    assert len(got["odd"].outputs[0].token_ids) == 6
    assert got["logprobs"].metrics.num_accepted_tokens > 0
    assert got["shared2"].usage.cached_prompt_tokens > 0


def test_penalties_and_switched_off_rows_beside_speculating_ones(ngram):
    requests = {
        "spec": (prompt(6, 20) * 2, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)),
        "off": (prompt(6, 20) * 2, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, speculative=False)),
        "penalty": (prompt(7, 9), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, repetition_penalty=1.3)),
    }
    got = compare_with_plain(ngram, requests, async_scheduling=True)
    assert got["off"].metrics.num_draft_tokens == got["penalty"].metrics.num_draft_tokens == 0
    assert got["spec"].metrics.num_draft_tokens > 0  # after the penalty request finished


def test_aborts_free_every_page(self_draft):
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    requests = {"kept": (prompt(6, 10), greedy), "dropped": (prompt(7, 10), greedy)}
    full = run(self_draft, {"dropped": (prompt(7, 10), greedy)})
    got = run(self_draft, requests, abort_after={3: "dropped"})
    want = run(self_draft, {"kept": (prompt(6, 10), greedy)})
    assert tokens(got)["kept"] == tokens(want)["kept"]
    dropped = got["dropped"].outputs[0]
    assert dropped.finish_reason == "abort"
    assert dropped.token_ids == full["dropped"].outputs[0].token_ids[: len(dropped.token_ids)]


def test_tiny_vocabulary_distributions_agree(model):
    """Vocabulary 24, temperature 1: each of the 2nd to 6th sampled tokens of 300 requests with
    speculation and 300 without (other seeds) pass a two-sample chi-square test (rare tokens
    pooled); with the same seed both give the same tokens."""
    config = dataclasses.replace(model.config, vocab_size=24)
    tiny = dataclasses.replace(
        model, config=config, tokenizer=None, params=init_params(config, jax.random.key(3), scale=2.0)
    )
    engine = make_engine(
        tiny,
        {"method": "ngram", "num_speculative_tokens": 3},
        num_pages=64,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        token_buckets=(64,),
        penalties=False,
    )
    n, head = 300, list(range(24)) * 2  # every token seen: each step has n-gram drafts

    def sampled(seeds, speculative):
        params = {
            s: SamplingParams(temperature=1.0, seed=s, max_tokens=6, ignore_eos=True, speculative=speculative)
            for s in seeds
        }
        out = run(engine, {str(s): (head, p) for s, p in params.items()})
        return out, np.array([out[str(s)].outputs[0].token_ids for s in seeds])

    spec_out, spec = sampled(range(n), True)
    _, plain = sampled(range(n, 2 * n), False)
    assert sum(o.metrics.num_accepted_tokens for o in spec_out.values()) > 50
    for pos in range(1, 6):  # the tokens after the first (which a prefill samples)
        table = np.array([np.bincount(spec[:, pos], minlength=24), np.bincount(plain[:, pos], minlength=24)])
        common = table.sum(0) >= 10
        table = np.column_stack([table[:, common], table[:, ~common].sum(1)])
        table = table[:, table.sum(0) > 0]
        assert stats.chi2_contingency(table).pvalue > 1e-3, f"token {pos}"
    _, same = sampled(range(20), False)
    np.testing.assert_array_equal(same, spec[:20])
