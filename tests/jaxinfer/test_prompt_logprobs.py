"""Prompt logprobs (SamplingParams.prompt_logprobs) on a tiny random Llama: HF parity of every
prompt token's logprob, rank and top-N under chunked prefill, with the async loop and decode
windows (the defaults) and with the synchronous loop; greedy outputs unchanged (HF's); each
prompt scored once whatever the prefix cache holds, after preemption, and with n > 1; the same
values the sampler gives the tokens it samples; nothing compiles after warm-up, and the plain
step's LM head stays over one row per sequence; engines started without them refuse them.
Host-side: which rows a plan scores, and which cached pages a prompt being scored may take."""

import re
from pathlib import Path

import jax
import numpy as np
import pytest
from testpaths import FIXTURES

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.core.plan import ScheduledSeq, SchedulerPlan
from jaxinfer.core.scheduler import Scheduler
from jaxinfer.core.sequence import Sequence, SequenceStatus
from jaxinfer.engine import Engine
from jaxinfer.kv import KVCacheManager
from jaxinfer.loader import LoadedModel, load_model
from jaxinfer.models.registry import get_family
from jaxinfer.sampling import SamplingParams
from jaxinfer.worker.inputs import InputBuilder, prompt_inputs
from jaxinfer.worker.worker import Worker

GOLDEN = np.load(FIXTURES / "hf" / "llama3" / "golden.npz")
PROMPT = GOLDEN["input_ids"].tolist()  # 64 tokens; HF's logits over them: GOLDEN["logits"]
TOP = 5


@pytest.fixture(scope="module")
def model():
    return load_model(FIXTURES / "hf" / "llama3", dtype="float32")


# 32-token steps: the 64-token prompt is computed over two or three chunks; 12 pages of 16
# tokens: two such prompts preempt. Async scheduling and decode windows: the defaults.
ENGINE = dict(
    num_pages=13,
    page_size=16,
    max_num_batched_tokens=32,
    max_num_seqs=4,
    max_model_len=256,
    token_buckets=(8, 32),
    enable_prompt_logprobs=True,
)


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, EngineConfig(**ENGINE))


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
    assert engine.kv_cache.num_free_pages == engine.kv_cache.num_usable_pages
    return [results[i] for i in ids]


def hf_reference(prompt=PROMPT):
    """Each position's log_softmax, the next token's logprob and rank under HF's logits."""
    logits = GOLDEN["logits"].astype(np.float64)[: len(prompt) - 1]
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
        assert len(lp.top) == top and lp.as_dict()[lp.token_id] == lp.logprob and lp.top.items() <= lp.as_dict().items()
        order = np.argsort(-full[p], kind="stable")[:top]  # the N highest (ties in any order)
        np.testing.assert_allclose(sorted(lp.top.values(), reverse=True), full[p][order], atol=2e-5)
        np.testing.assert_allclose([lp.top[t] for t in lp.top], full[p][list(lp.top)], atol=2e-5)


def test_prompt_logprobs_match_hf_over_chunked_prefill(engine):
    compiled = engine.worker.num_compiled()
    (out,) = run(engine, (PROMPT, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=TOP)))
    check_against_hf(out.prompt_logprobs)
    assert out.outputs[0].logprobs is None  # the sampled tokens' logprobs were not asked for
    assert out.outputs[0].token_ids == GOLDEN["greedy"][:4].tolist()  # greedy output unchanged (HF's)
    # Cached prefix pages are not taken by a prompt being scored: the same prompt again scores
    # every position, and a request without prompt logprobs then hits the cache.
    again, plain = run(
        engine,
        (PROMPT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)),
        (PROMPT, SamplingParams(temperature=0, max_tokens=2)),
    )
    assert again.usage.cached_prompt_tokens == 0 and plain.usage.cached_prompt_tokens > 0
    assert plain.prompt_logprobs is None
    assert again.outputs[0].token_ids == plain.outputs[0].token_ids == GOLDEN["greedy"][:2].tolist()
    np.testing.assert_allclose(
        [lp.logprob for lp in again.prompt_logprobs[1:]], [lp.logprob for lp in out.prompt_logprobs[1:]], atol=1e-6
    )
    assert all(lp.top == {} for lp in again.prompt_logprobs[1:])  # prompt_logprobs=0: the token's own
    assert engine.worker.num_compiled() == compiled  # every variant was compiled at warm-up


def test_a_scoring_request_fills_the_context_and_generates_nothing(model):
    """max_tokens=0 (what echo with max_tokens 0 asks over HTTP): the 64-token prompt fills a
    64-token context, every position is scored as HF scores it, nothing is generated, and the
    request ends for length; one generated token more is refused before it is queued."""
    engine = Engine(model, EngineConfig(**{**ENGINE, "max_model_len": 64}))
    (out,) = run(engine, (PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=TOP, logprobs=1)))
    check_against_hf(out.prompt_logprobs)
    (completion,) = out.outputs
    assert (completion.token_ids, completion.text, completion.logprobs) == ([], "", [])
    assert completion.finish_reason == "length" and out.usage.completion_tokens == 0 and out.finished
    with pytest.raises(ValueError, match="prompt of 64 tokens fills the context of 64 tokens"):
        engine.add_request(PROMPT, SamplingParams(max_tokens=1))


def test_prompt_logprobs_agree_with_the_sampled_tokens_logprobs(engine):
    """The prompt logprobs of a greedy continuation fed back as a prompt are the logprobs the
    sampler gave those tokens when it chose them."""
    prompt = PROMPT[:20]
    (first,) = run(engine, (prompt, SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)))
    generated = first.outputs[0].token_ids
    (scored,) = run(engine, (prompt + generated, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3)))
    tail = scored.prompt_logprobs[len(prompt) :]
    assert [lp.token_id for lp in tail] == generated
    np.testing.assert_allclose([lp.logprob for lp in tail], [lp.logprob for lp in first.outputs[0].logprobs], atol=2e-5)
    assert all(lp.rank == 1 for lp in tail)  # greedy: each was the most likely token
    for a, b in zip(tail, first.outputs[0].logprobs):
        assert a.top.keys() == b.top.keys()


def test_preemption_n_and_mixed_batches_score_each_prompt_once(engine):
    """Two 64-token prompts with 12 usable pages: one is preempted and recomputed, yet every
    position is recorded once; n=2 scores the shared prompt once; a request without prompt
    logprobs in the same steps is untouched."""
    params = SamplingParams(temperature=0, max_tokens=24, prompt_logprobs=TOP, ignore_eos=True)
    preemptions = engine.num_preemptions
    a, b, c = run(
        engine,
        (PROMPT, params),
        (PROMPT, SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=24, prompt_logprobs=TOP, ignore_eos=True)),
        (PROMPT[:30], SamplingParams(temperature=0, max_tokens=4)),
    )
    assert engine.num_preemptions > preemptions
    check_against_hf(a.prompt_logprobs)
    check_against_hf(b.prompt_logprobs)
    assert a.outputs[0].token_ids == GOLDEN["greedy"][:24].tolist()
    assert len(b.outputs) == 2 and c.prompt_logprobs is None and len(c.outputs[0].token_ids) == 4


def test_the_synchronous_loop_scores_the_same(model):
    """The test oracle: one step at a time, no decode windows, no penalty variants."""
    sync = Engine(model, EngineConfig(**ENGINE, async_scheduling=False, num_decode_steps=1, penalties=False))
    compiled = sync.worker.num_compiled()
    out, pair = run(
        sync,
        (PROMPT, SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=TOP)),
        (PROMPT[:40], SamplingParams(n=2, temperature=0, max_tokens=3, prompt_logprobs=1)),
    )
    check_against_hf(out.prompt_logprobs)
    check_against_hf(pair.prompt_logprobs, PROMPT[:40], top=1)
    assert out.outputs[0].token_ids == GOLDEN["greedy"][:6].tolist()
    assert sync.worker.num_compiled() == compiled


def test_one_token_prompt_has_only_the_leading_none(engine):
    (out,) = run(engine, ([PROMPT[0]], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)))
    assert out.prompt_logprobs == [None]


def test_engines_without_prompt_logprobs_refuse_them(model):
    plain = Engine(
        model,
        EngineConfig(
            num_pages=8,
            page_size=16,
            max_num_batched_tokens=8,
            max_num_seqs=2,
            max_model_len=64,
            token_buckets=(8,),
            penalties=False,
        ),
        warm_up=False,
    )
    with pytest.raises(ValueError, match=r"prompt_logprobs=1: .*enable_prompt_logprobs"):
        plain.add_request(PROMPT[:8], SamplingParams(prompt_logprobs=1))
    with pytest.raises(ValueError, match="prompt_logprobs=21"):
        SamplingParams(prompt_logprobs=21)
    for bad in (True, -1, 2.0, "3"):
        with pytest.raises(ValueError, match=rf"SamplingParams.prompt_logprobs={bad!r}: must be None or an integer"):
            SamplingParams(prompt_logprobs=bad)
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(enable_prompt_logprobs=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="enable_prompt_logprobs must be a bool"):
        EngineConfig(enable_prompt_logprobs="yes")


def _seq(seq_id, prompt, prompt_logprobs, sample_index=0):
    return Sequence(
        seq_id,
        f"r{seq_id}",
        prompt,
        SamplingParams(prompt_logprobs=prompt_logprobs),
        seed=0,
        arrival=seq_id,
        sample_index=sample_index,
    )


def test_prompt_rows_of_a_plan():
    """Which rows a step scores: the rows of a prompt chunk before the prompt's last token, for
    sample 0 of requests that asked; none for decodes, other samples or other requests."""
    scored, other, sibling = _seq(0, list(range(10, 20)), 2), _seq(1, [1, 2, 3], None), _seq(2, [5, 6, 7], 0, 1)
    plan = SchedulerPlan(
        [
            ScheduledSeq(other, 0, 3, (1,), True),
            ScheduledSeq(scored, 4, 6, (2,), True),
            ScheduledSeq(sibling, 0, 3, (3,), True),
        ]
    )
    inputs = prompt_inputs(plan, 16)
    # Rows 3..8 hold positions 4..9 of `scored`: positions 4..8 predict tokens 15..19, 9 is the last.
    assert inputs.targets.tolist() == [-1] * 3 + [15, 16, 17, 18, 19] + [-1] * 8
    assert inputs.num_top.tolist() == [2]
    assert prompt_inputs(SchedulerPlan([ScheduledSeq(other, 0, 3, (1,), True)]), 16) is None
    # A prompt computed again (preempted): the positions scored before are not scored again.
    scored.num_scored_prompt = 6
    assert prompt_inputs(plan, 16).targets.tolist() == [-1] * 5 + [17, 18, 19] + [-1] * 8
    scored.num_scored_prompt = 9
    assert prompt_inputs(plan, 16) is None


def test_a_prompt_being_scored_takes_only_cached_pages_it_has_scored():
    """Cached prefix pages were computed without scoring: a prompt being scored computes every
    position itself, except (computed again after a preemption) the pages it has scored; a
    request without prompt logprobs, or one whose prompt is scored, takes the whole prefix."""
    sched = Scheduler(KVCacheManager(33, 4), max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256)
    shared = list(range(100, 112))
    sched.add_request("first", shared + [1, 2], SamplingParams(max_tokens=1))
    sched.update(sched.schedule(), [7])  # first's pages of `shared` are in the prefix cache

    def admitted(request_id, prompt_logprobs, num_scored=0):
        (seq,) = sched.add_request(
            request_id, shared + [3], SamplingParams(max_tokens=1, prompt_logprobs=prompt_logprobs)
        )
        seq.num_scored_prompt = num_scored
        (entry,) = sched.schedule().seqs
        sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return entry.start

    assert admitted("scored", 0) == 0
    assert admitted("resumed", 2, num_scored=9) == 8  # 9 positions scored: their 2 full pages
    assert admitted("plain", None) == 12
    assert admitted("done", 1, num_scored=12) == 12  # every position scored: no more scoring


def tiny_llama(**config) -> LoadedModel:
    """A one-layer Llama of random weights (`config`: ModelConfig fields over the defaults here)."""
    shape = dict(hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)
    config = ModelConfig(
        model_type="llama",
        family="llama",
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
        **{**shape, **config},
    )
    family = get_family("llama")
    return LoadedModel(config, family.init_params(config, jax.random.key(0)), None, family, Path("random"))


def test_only_the_scoring_variant_runs_the_lm_head_over_every_row():
    """The plain step's LM head is over one row per sequence [S, V]; the variant that scores
    prompts adds [T, V] (the normal step's cost does not grow)."""
    tiny = tiny_llama(vocab_size=256)
    runner = Worker(
        tiny,
        EngineConfig(
            page_size=16,
            max_num_batched_tokens=8,
            max_num_seqs=2,
            token_buckets=(8,),
            penalties=False,
            num_pages=8,
            compilation_cache_dir=None,
            enable_prompt_logprobs=True,
        ),
        512,
    )

    def lm_head_rows(prompt: bool) -> list[int]:
        text = runner.step.lower(runner.step.padding_inputs(8, False, prompt=prompt)).as_text()
        return sorted(int(m) for m in re.findall(r"dot_general .*-> tensor<(\d+)x256xf32>", text))

    assert lm_head_rows(False) == [2] and lm_head_rows(True) == [2, 8]


def test_scoring_as_many_rows_as_the_sampler_writes_no_broadcast_of_the_lm_head():
    """On the CPU a few rows' LM head is a product and a sum over the weight broadcast to
    [V, rows, E] (quant/out_first.py), fused into the sum. When the prompt rows of a bucket are as
    many as its sequence rows, the two heads' broadcasts were one instruction with two users, which
    XLA wrote out in full: 50-60 ms a row for SmolLM2's 49k vocabulary (lm-eval's scoring requests
    of 8-32 tokens took 0.4-2 s). Each head now has its own (step.py): the step's temporaries stay
    far below one such broadcast."""
    tiny = tiny_llama(vocab_size=4096, tie_word_embeddings=True)  # the head is the embedding [V, E]
    config = tiny.config
    options = dict(page_size=16, max_num_batched_tokens=8, max_num_seqs=8, token_buckets=(8,), penalties=False)
    runner = Worker(
        tiny, EngineConfig(**options, num_pages=8, compilation_cache_dir=None, enable_prompt_logprobs=True), 512
    )
    inputs = runner.step.padding_inputs(8, False, prompt=True)
    assert inputs.token_ids.shape[-1] == runner.step.engine.seq_bucket(8) == 8  # as many rows as sequences
    broadcast = config.vocab_size * 8 * config.hidden_size * 4
    temp = runner.step.lower(inputs).compile().memory_analysis().temp_size_in_bytes
    assert temp < broadcast / 2, (temp, broadcast)


def test_data_replicas_share_one_input_tree():
    """With data replicas, a replica whose plan scores nothing gets all -1 targets (the stacked
    inputs keep one tree)."""
    engine_cfg = EngineConfig(page_size=16, max_num_batched_tokens=16, max_num_seqs=4, token_buckets=(16,))
    builder = InputBuilder(engine_cfg, (16,), pages_per_seq=4, max_model_len=64, vocab_size=512, num_replicas=2)
    scored, other = _seq(0, list(range(10, 20)), 1), _seq(1, [1, 2, 3], None)
    inputs = builder.prepare(
        [
            SchedulerPlan([ScheduledSeq(scored, 0, 10, (1,), True)]),
            SchedulerPlan([ScheduledSeq(other, 0, 3, (2,), True)]),
        ]
    )
    assert inputs.prompt.targets.shape == (2, 16)
    assert inputs.prompt.targets[0, :9].tolist() == list(range(11, 20)) and (inputs.prompt.targets[1] == -1).all()
