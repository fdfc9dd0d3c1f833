"""Speculative decoding, unit by unit: the config, the n-gram lookup, the in-jit verification
(greedy prefix, the same draws as the plain sampler, output distributions by chi-square for the
coupled rule and for the general rule with explicit p and q), and the host bookkeeping (drafts
cut to budget and pages, verified tokens, stops inside the run, pages rolled back)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxinfer.config import EngineConfig
from jaxinfer.config.speculative import SpeculativeConfig
from jaxinfer.core.scheduler import Scheduler
from jaxinfer.kv import KVCacheManager
from jaxinfer.sampling import SamplingParams
from jaxinfer.sampling.arrays import make_sampling_arrays
from jaxinfer.sampling.rejection import SpecInputs, VerifyOutput, rejection_sample
from jaxinfer.sampling.rejection import verify as verify_fn
from jaxinfer.sampling.sampler import SamplerOutput
from jaxinfer.sampling.sampler import sample as sample_fn
from jaxinfer.spec_decode import NgramProposer, Speculator, ngram_lookup


# --- config ---------------------------------------------------------------------------------
def test_config_parses_dicts_and_json():
    c = SpeculativeConfig.parse(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    )
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == ("ngram", 4, 3, 2)
    assert (
        SpeculativeConfig.parse('{"method": "draft_model", "model": "/m", "num_speculative_tokens": 2}').model == "/m"
    )
    assert EngineConfig(
        speculative_config={"method": "ngram", "num_speculative_tokens": 1}
    ).speculative_config == SpeculativeConfig("ngram", 1)
    assert EngineConfig().speculative_config is None


@pytest.mark.parametrize(
    "value,message",
    [
        ({"method": "eagle9", "num_speculative_tokens": 4}, "speculative_config.method='eagle9'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
        ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens=17"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens=True"),
        ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens='4'"),
        ({"method": "ngram", "num_speculative_tokens": 4, "lookahead": 2}, "speculative_config.lookahead"),
        ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5}, "prompt_lookup_min=5"),
        ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 0}, "prompt_lookup_max=0"),
        ({"method": "draft_model", "num_speculative_tokens": 4}, "speculative_config.model=None"),
        ({"method": "ngram", "num_speculative_tokens": 4, "model": "/m"}, "speculative_config.model='/m'"),
        ({"num_speculative_tokens": 4}, "speculative_config.method: required"),
        ("{not json", "not valid JSON"),
        ([1, 2], "must be an object"),
    ],
)
def test_bad_configs_are_named(value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        EngineConfig(speculative_config=value)


def test_sampling_params_switch():
    assert SamplingParams().speculative is True
    assert SamplingParams(speculative=False).speculative is False
    with pytest.raises(ValueError, match="SamplingParams.speculative=1"):
        SamplingParams(speculative=1)


# --- n-gram lookup ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "tokens,k,min_n,max_n,want",
    [
        ([1, 2, 3, 4, 5, 9, 1, 2, 3], 3, 1, 3, [4, 5, 9]),  # the 3-gram suffix seen before
        ([1, 2, 3, 4, 5, 9, 1, 2, 3], 9, 1, 3, [4, 5, 9, 1, 2, 3]),  # up to the end of the tokens
        ([7, 1, 8, 2, 3, 7, 2, 3], 2, 1, 2, [7, 2]),  # the 2-gram [2, 3] wins over [3]
        ([5, 6, 1, 5, 7, 2, 5], 1, 1, 2, [7]),  # the latest of two 1-gram matches
        ([4, 4, 4, 4, 4], 2, 1, 3, [4, 4]),  # a repeat: full continuation
        ([1, 2, 3, 4], 3, 1, 3, []),  # no earlier occurrence
        ([1, 2, 9, 1, 2], 2, 3, 3, []),  # only n >= 3 may match
        ([3], 2, 1, 2, []),
    ],
)
def test_ngram_lookup(tokens, k, min_n, max_n, want):
    assert ngram_lookup(np.array(tokens), k, min_n, max_n).tolist() == want


def test_ngram_prefers_a_match_with_a_full_continuation():
    # the suffix [1, 2] occurred at 0 (followed by 3 4 5 ...) and at 5 (followed by just 1 2)
    tokens = np.array([1, 2, 3, 4, 5, 1, 2, 1, 2])
    assert ngram_lookup(tokens, 3, 2, 2).tolist() == [3, 4, 5]
    assert ngram_lookup(tokens, 2, 2, 2).tolist() == [1, 2]


# --- in-jit verification ----------------------------------------------------------------------
verify = jax.jit(verify_fn, static_argnames="num_top_logprobs")
sample = jax.jit(sample_fn, static_argnums=2)


def _arrays(rows, temperature=0.0, seeds=None, num_generated=None, top_k=-1):
    params = [SamplingParams(temperature=temperature, top_k=top_k)] * rows
    return jax.tree.map(
        jnp.asarray,
        make_sampling_arrays(
            params,
            num_generated if num_generated is not None else [0] * rows,
            batch_size=rows,
            seeds=seeds if seeds is not None else [0] * rows,
        ),
    )


def test_greedy_verification_accepts_the_matching_prefix():
    vocab = 10
    best = np.array([[4, 7, 1, 2], [5, 5, 5, 5], [0, 3, 3, 9]])  # the argmax at each position
    logits = jax.nn.one_hot(best.reshape(-1), vocab) * 5.0
    drafts = np.array([[4, 7, 2], [5, 1, -1], [8, 3, 3]])
    spec = SpecInputs(jnp.asarray(drafts, jnp.int32), jnp.array([3, 1, 3], jnp.int32))
    out = verify(logits, _arrays(3), spec)
    assert out.num_accepted.tolist() == [2, 1, 0]
    assert out.sampled.tokens.tolist() == best.tolist()


def test_each_position_draws_as_the_plain_sampler_would():
    """Position j of a row samples with the row's stream at num_generated + j: the token plain
    decoding would sample there (so seeded outputs do not change with speculation)."""
    rows, k, vocab = 4, 3, 50
    logits = jax.random.normal(jax.random.key(1), (rows * (k + 1), vocab)) * 2
    seeds, generated = [11, 12, 13, 14], [0, 5, 9, 2]
    spec = SpecInputs(jnp.full((rows, k), -1, jnp.int32), jnp.zeros(rows, jnp.int32))
    out = verify(logits, _arrays(rows, 0.8, seeds, generated, top_k=20), spec, num_top_logprobs=2)
    for j in range(k + 1):
        plain = sample(logits[j :: k + 1], _arrays(rows, 0.8, seeds, [g + j for g in generated], top_k=20), 2)
        np.testing.assert_array_equal(out.sampled.tokens[:, j], plain.tokens)
        np.testing.assert_allclose(out.sampled.logprobs[:, j], plain.logprobs, rtol=1e-6)
        np.testing.assert_array_equal(out.sampled.top_ids[:, j], plain.top_ids)


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return stats.chisquare(counts[keep], probs[keep] / probs[keep].sum() * counts.sum()).pvalue


def test_coupled_rule_keeps_the_target_distribution():
    """A one-hot draft x: accepted with probability p(x); the emitted token is distributed as p."""
    rows, k, vocab = 20000, 1, 6
    row_logits = jnp.log(jnp.array([0.05, 0.4, 0.25, 0.2, 0.1, 1e-9]))
    logits = jnp.tile(row_logits, (rows * (k + 1), 1))
    draft = 2
    spec = SpecInputs(jnp.full((rows, k), draft, jnp.int32), jnp.ones(rows, jnp.int32))
    out = verify(logits, _arrays(rows, 1.0, seeds=list(range(rows))), spec)
    p = np.asarray(jax.nn.softmax(row_logits))
    first = np.asarray(out.sampled.tokens[:, 0])
    assert _chi_square_p(np.bincount(first, minlength=vocab), p) > 1e-3
    accepted = np.asarray(out.num_accepted) == 1
    assert abs(accepted.mean() - p[draft]) < 0.015
    np.testing.assert_array_equal(accepted, first == draft)


def test_rejection_sampling_with_explicit_p_and_q():
    """Leviathan et al.'s rule: emitted tokens follow p position by position, whatever q drafted
    them; the acceptance rate at a position is sum(min(p, q))."""
    rows, k, vocab = 40000, 2, 5
    p = np.array([[0.1, 0.2, 0.3, 0.4, 0.0], [0.5, 0.1, 0.1, 0.1, 0.2], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = np.array([[0.3, 0.3, 0.1, 0.1, 0.2], [0.05, 0.05, 0.6, 0.2, 0.1]])
    key_d, key_r = jax.random.split(jax.random.key(7))
    drafts = jax.random.categorical(key_d, jnp.log(jnp.asarray(q)), shape=(rows, k)).astype(jnp.int32)
    tokens, accepted = jax.jit(rejection_sample)(
        jnp.broadcast_to(p, (rows, k + 1, vocab)),
        jnp.broadcast_to(q, (rows, k, vocab)),
        drafts,
        jnp.full((rows,), k, jnp.int32),
        key_r,
    )
    tokens, accepted = np.asarray(tokens), np.asarray(accepted)
    assert _chi_square_p(np.bincount(tokens[:, 0], minlength=vocab), p[0]) > 1e-3
    second = tokens[accepted >= 1, 1]  # the token after an accepted first draft follows p[1]
    assert _chi_square_p(np.bincount(second, minlength=vocab), p[1]) > 1e-3
    third = tokens[accepted == 2, 2]  # the bonus token after both drafts: p[2]
    assert _chi_square_p(np.bincount(third, minlength=vocab), p[2]) > 1e-3
    assert abs((accepted >= 1).mean() - np.minimum(p[0], q[0]).sum()) < 0.01
    np.testing.assert_array_equal(
        tokens[:, :k][np.arange(k) < accepted[:, None]], np.asarray(drafts)[np.arange(k) < accepted[:, None]]
    )


# --- host bookkeeping ---------------------------------------------------------------------------
def _fake_verify(tokens, accepted):
    t = np.asarray(tokens, np.int32)
    zeros = np.zeros(t.shape, np.float32)
    return VerifyOutput(
        SamplerOutput(t, zeros, np.zeros(t.shape + (1,), np.int32), np.zeros(t.shape + (1,), np.float32)),
        np.asarray(accepted, np.int32),
    )


def _land(speculator, scheduler, plan, tokens, accepted):
    scheduler.advance(plan)
    return [
        (j, sorted(ids))
        for j, (_, ids) in enumerate(speculator.resolve(plan, _fake_verify(tokens, accepted), scheduler))
    ]


def test_drafts_are_scheduled_verified_and_rolled_back():
    kv_cache = KVCacheManager(12, 4, enable_prefix_caching=False)
    scheduler = Scheduler(kv_cache, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64, eos_token_ids=[99])
    speculator = Speculator(SpeculativeConfig("ngram", 4), NgramProposer(4, 1, 2), max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=20)
    (seq,) = scheduler.add_request("a", [1, 2, 3, 4, 5, 6, 1, 2], params)
    scheduler.update(scheduler.schedule(), [3])  # prefill samples 3: [..., 1, 2, 3] -> drafts 4 5 6 1
    speculator.propose(scheduler)
    assert seq.draft_token_ids == [4, 5, 6, 1]
    plan = scheduler.schedule()
    (entry,) = plan.seqs
    assert (entry.start, entry.num_new_tokens, entry.drafts, entry.token_ids) == (8, 5, (4, 5, 6, 1), [3, 4, 5, 6, 1])
    assert len(seq.pages) == 4  # 13 slots
    # the target agrees with 4 and 5, then says 7: tokens 4 5 7 emitted
    landed = _land(speculator, scheduler, plan, [[4, 5, 7, 0, 0]], [2])
    assert landed == [(0, [seq.seq_id]), (1, [seq.seq_id]), (2, [seq.seq_id])]
    assert seq.output_token_ids == [3, 4, 5, 7] and seq.num_computed_tokens == 11 and seq.num_tokens == 12
    assert len(seq.pages) == 3  # the page that held only rejected drafts is free again
    assert kv_cache.num_free_pages == kv_cache.num_usable_pages - 3
    assert (seq.num_draft_tokens, seq.num_accepted_tokens, seq.num_verify_steps) == (4, 2, 1)


def test_a_stop_inside_the_accepted_run_drops_the_rest():
    kv_cache = KVCacheManager(12, 4, enable_prefix_caching=False)
    scheduler = Scheduler(kv_cache, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64, eos_token_ids=[99])
    speculator = Speculator(SpeculativeConfig("ngram", 3), NgramProposer(3, 1, 2), max_model_len=64)
    (seq,) = scheduler.add_request(
        "a", [1, 2, 3, 1, 2], SamplingParams(temperature=0, max_tokens=9, stop_token_ids=[5])
    )
    scheduler.update(scheduler.schedule(), [3])
    speculator.propose(scheduler)
    plan = scheduler.schedule()
    assert plan.seqs[0].drafts == (1, 2, 3)
    landed = _land(speculator, scheduler, plan, [[1, 5, 8, 8]], [3])  # 5 is a stop id: 8 8 dropped
    assert [j for j, _ in landed] == [0, 1]
    assert seq.output_token_ids == [3, 1, 5] and seq.is_finished and seq.stop_reason == 5
    assert seq.pages == [] and kv_cache.num_free_pages == kv_cache.num_usable_pages


@pytest.mark.parametrize("num_pages,budget,want", [(8, 16, 3), (4, 16, 1), (8, 3, 2)])
def test_drafts_respect_max_tokens_pages_and_budget(num_pages, budget, want):
    """max_tokens 5 after 1 output: 3 drafts + 1 bonus at most; 3 pages of 4 with one taken by
    the other request: 7 + 1 tokens; a budget of 3 tokens: the known token and 2 drafts. Drafts
    never preempt."""
    kv_cache = KVCacheManager(num_pages, 4, enable_prefix_caching=False)
    scheduler = Scheduler(kv_cache, max_num_batched_tokens=budget, max_num_seqs=4, max_model_len=64)
    speculator = Speculator(SpeculativeConfig("ngram", 8), NgramProposer(8, 1, 1), max_model_len=64)
    (seq,) = scheduler.add_request("a", [7] * 6, SamplingParams(temperature=0, max_tokens=5))
    (off,) = scheduler.add_request("b", [7], SamplingParams(temperature=0, max_tokens=3, speculative=False))
    while seq.num_output_tokens == 0 or off.num_output_tokens == 0:
        plan = scheduler.schedule()
        scheduler.update(plan, [7] * len(plan.seqs))
    speculator.propose(scheduler)
    assert seq.draft_token_ids == [7] * (4 - seq.num_output_tokens) and off.draft_token_ids == []
    plan = scheduler.schedule()
    assert plan.seqs[0].seq is seq and len(plan.seqs[0].drafts) == min(want, 4 - seq.num_output_tokens)
    assert scheduler.num_running == 2 and not plan.preempted


def test_rejected_drafts_back_off():
    """Two verify steps in a row without an accepted draft: the sequence sits out 1, then 2
    proposals; an accepted draft ends the back-off."""
    kv_cache = KVCacheManager(40, 4, enable_prefix_caching=False)
    scheduler = Scheduler(kv_cache, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=128)
    speculator = Speculator(SpeculativeConfig("ngram", 2), NgramProposer(2, 1, 1), max_model_len=128)
    (seq,) = scheduler.add_request("a", [3, 3, 3, 3], SamplingParams(temperature=0, max_tokens=60))
    scheduler.update(scheduler.schedule(), [3])
    drafted = []
    for verdict in ("miss", "miss", "-", "miss", "-", "-", "hit", "hit"):
        speculator.propose(scheduler)
        drafted.append(bool(seq.draft_token_ids))
        plan = scheduler.schedule()
        if plan.verifies:
            accepted = 1 if verdict == "hit" else 0
            _land(speculator, scheduler, plan, [[3, 9 if accepted == 0 else 3, 3]], [accepted])
        else:
            scheduler.update(plan, [3])
    assert drafted == [True, True, False, True, False, False, True, True]
