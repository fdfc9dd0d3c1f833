"""Prompt logprobs (SamplingParams.prompt_logprobs) on a tiny random Llama: HF parity of every
prompt token's logprob, rank and top-N under chunked prefill; each prompt scored once whatever
the prefix cache holds, after preemption, and with n > 1; the same values the sampler gives the
tokens it samples; nothing compiles after warm-up; engines started without them refuse them."""
import jax
import numpy as np
import pytest
from testpaths import FIXTURES

from jaxinfer.config import EngineConfig
from jaxinfer.core.plan import ScheduledSeq, SchedulerPlan
from jaxinfer.core.sequence import Sequence
from jaxinfer.engine import Engine
from jaxinfer.inputs import InputBuilder, prompt_inputs
from jaxinfer.loader import load_model
from jaxinfer.sampling import SamplingParams

GOLDEN = np.load(FIXTURES / "hf" / "llama3" / "golden.npz")
PROMPT = GOLDEN["input_ids"].tolist()  # 64 tokens; HF's logits over them: GOLDEN["logits"]
TOP = 5


@pytest.fixture(scope="module")
def model():
    return load_model(FIXTURES / "hf" / "llama3", dtype="float32")


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
    # 32-token steps: the 64-token prompt is scored over three chunks (two steps of 32 would
    # leave the last position to a third), 12 pages of 16 tokens: two such prompts preempt.
    return Engine(model, EngineConfig(
        num_pages=13, page_size=16, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=256,
        token_buckets=(8, 32), enable_prompt_logprobs=True,
        compilation_cache_dir=str(tmp_path_factory.mktemp("xla"))))


def run(engine, *requests) -> list:
    """(prompt, params) requests to completion; their accumulated outputs in order."""
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    results = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.request_id in results:
                results[delta.request_id].merge(delta)
            else:
                results[delta.request_id] = delta
    assert engine.pool.num_free_pages == engine.pool.num_usable_pages
    return [results[i] for i in ids]


def hf_reference(prompt=PROMPT):
    """Each position's log_softmax, the next token's logprob and rank under HF's logits."""
    logits = GOLDEN["logits"].astype(np.float64)[:len(prompt) - 1]
    logprobs = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    targets = np.array(prompt[1:])
    chosen = logits[np.arange(len(targets)), targets]
    ranks = 1 + (logits > chosen[:, None]).sum(-1)
    return logprobs, logprobs[np.arange(len(targets)), targets], ranks


def check_against_hf(prompt_logprobs, prompt=PROMPT, top=TOP):
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    full, chosen, ranks = hf_reference(prompt)
    scored = prompt_logprobs[1:]
    assert [lp.token_id for lp in scored] == prompt[1:]
    np.testing.assert_allclose([lp.logprob for lp in scored], chosen, atol=2e-5)
    assert [lp.rank for lp in scored] == ranks.tolist()
    for p, lp in enumerate(scored):
        assert len(lp.top) == top
        order = np.argsort(-full[p], kind="stable")[:top]  # the N highest (ties in any order)
        np.testing.assert_allclose(sorted(lp.top.values(), reverse=True), full[p][order], atol=2e-5)
        np.testing.assert_allclose([lp.top[t] for t in lp.top], full[p][list(lp.top)], atol=2e-5)


def test_prompt_logprobs_match_hf_over_chunked_prefill(engine):
    compiled = engine.runner.num_compiled()
    (out,) = run(engine, (PROMPT, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=TOP)))
    check_against_hf(out.prompt_logprobs)
    assert out.outputs[0].logprobs is None  # the sampled tokens' logprobs were not asked for
    # Cached prefix pages are not taken by a prompt being scored: the same prompt again scores
    # every position, and a request without prompt logprobs then hits the cache.
    again, plain = run(engine, (PROMPT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)),
                       (PROMPT, SamplingParams(temperature=0, max_tokens=2)))
    assert again.usage.cached_prompt_tokens == 0 and plain.usage.cached_prompt_tokens > 0
    assert plain.prompt_logprobs is None
    np.testing.assert_allclose([lp.logprob for lp in again.prompt_logprobs[1:]],
                               [lp.logprob for lp in out.prompt_logprobs[1:]], atol=1e-6)
    assert all(lp.top == {} for lp in again.prompt_logprobs[1:])  # prompt_logprobs=0: the token's own
    assert engine.runner.num_compiled() == compiled  # every variant was compiled at warm-up


def test_prompt_logprobs_agree_with_the_sampled_tokens_logprobs(engine):
    """The prompt logprobs of a greedy continuation fed back as a prompt are the logprobs the
    sampler gave those tokens when it chose them."""
    prompt = PROMPT[:20]
    (first,) = run(engine, (prompt, SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)))
    generated = first.outputs[0].token_ids
    (scored,) = run(engine, (prompt + generated, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3)))
    tail = scored.prompt_logprobs[len(prompt):]
    assert [lp.token_id for lp in tail] == generated
    np.testing.assert_allclose([lp.logprob for lp in tail], [lp.logprob for lp in first.outputs[0].logprobs],
                               atol=2e-5)
    assert all(lp.rank == 1 for lp in tail)  # greedy: each was the most likely token
    for a, b in zip(tail, first.outputs[0].logprobs):
        assert a.top.keys() == b.top.keys()


def test_preemption_n_and_mixed_batches_score_each_prompt_once(engine):
    """Two 64-token prompts with 12 usable pages: one is preempted and recomputed, yet every
    position is recorded once; n=2 scores the shared prompt once; a request without prompt
    logprobs in the same steps is untouched."""
    params = SamplingParams(temperature=0, max_tokens=24, prompt_logprobs=TOP, ignore_eos=True)
    preemptions = engine.num_preemptions
    a, b, c = run(engine, (PROMPT, params), (PROMPT, SamplingParams(
        n=2, temperature=1.0, seed=7, max_tokens=24, prompt_logprobs=TOP, ignore_eos=True)),
        (PROMPT[:30], SamplingParams(temperature=0, max_tokens=4)))
    assert engine.num_preemptions > preemptions
    check_against_hf(a.prompt_logprobs)
    check_against_hf(b.prompt_logprobs)
    assert len(b.outputs) == 2 and c.prompt_logprobs is None and len(c.outputs[0].token_ids) == 4


def test_one_token_prompt_has_only_the_leading_none(engine):
    (out,) = run(engine, ([PROMPT[0]], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)))
    assert out.prompt_logprobs == [None]


def test_engines_without_prompt_logprobs_refuse_them(model, tmp_path_factory):
    plain = Engine(model, EngineConfig(num_pages=8, page_size=16, max_num_batched_tokens=8, max_num_seqs=2,
                                       max_model_len=64, token_buckets=(8,), penalties=False,
                                       compilation_cache_dir=str(tmp_path_factory.mktemp("xla"))), warm_up=False)
    with pytest.raises(ValueError, match=r"prompt_logprobs=1: .*enable_prompt_logprobs"):
        plain.add_request(PROMPT[:8], SamplingParams(prompt_logprobs=1))
    with pytest.raises(ValueError, match="prompt_logprobs=21"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs=True"):
        SamplingParams(prompt_logprobs=True)
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(enable_prompt_logprobs=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="enable_prompt_logprobs must be a bool"):
        EngineConfig(enable_prompt_logprobs="yes")


def _seq(seq_id, prompt, prompt_logprobs, sample_index=0):
    return Sequence(seq_id, f"r{seq_id}", prompt, SamplingParams(prompt_logprobs=prompt_logprobs),
                    seed=0, arrival=seq_id, sample_index=sample_index)


def test_prompt_rows_of_a_plan():
    """Which rows a step scores: the rows of a prompt chunk before the prompt's last token, for
    sample 0 of requests that asked; none for decodes, other samples or other requests."""
    scored, other, sibling = _seq(0, list(range(10, 20)), 2), _seq(1, [1, 2, 3], None), _seq(2, [5, 6, 7], 0, 1)
    plan = SchedulerPlan([ScheduledSeq(other, 0, 3, (1,), True), ScheduledSeq(scored, 4, 6, (2,), True),
                          ScheduledSeq(sibling, 0, 3, (3,), True)])
    inputs = prompt_inputs(plan, 16)
    # Rows 3..8 hold positions 4..9 of `scored`: positions 4..8 predict tokens 15..19, 9 is the last.
    assert inputs.targets.tolist() == [-1] * 3 + [15, 16, 17, 18, 19] + [-1] * 8
    assert inputs.num_top.tolist() == [2]
    assert prompt_inputs(SchedulerPlan([ScheduledSeq(other, 0, 3, (1,), True)]), 16) is None


def test_data_replicas_share_one_input_tree():
    """With data replicas, a replica whose plan scores nothing gets all -1 targets (the stacked
    inputs keep one tree)."""
    engine_cfg = EngineConfig(page_size=16, max_num_batched_tokens=16, max_num_seqs=4, token_buckets=(16,))
    builder = InputBuilder(engine_cfg, (16,), pages_per_seq=4, max_model_len=64, vocab_size=512, num_replicas=2)
    scored, other = _seq(0, list(range(10, 20)), 1), _seq(1, [1, 2, 3], None)
    inputs = builder.prepare([SchedulerPlan([ScheduledSeq(scored, 0, 10, (1,), True)]),
                              SchedulerPlan([ScheduledSeq(other, 0, 3, (2,), True)])])
    assert inputs.prompt.targets.shape == (2, 16)
    assert inputs.prompt.targets[0, :9].tolist() == list(range(11, 20)) and (inputs.prompt.targets[1] == -1).all()
