"""SamplingParams validation and the in-jit sampler against numpy references."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.sampling import SamplingParams
from jaxinfer.sampling.arrays import SamplingArrays, make_sampling_arrays, max_top_logprobs
from jaxinfer.sampling.sampler import apply_penalties, sample

sample_jit = jax.jit(sample, static_argnums=2)


# --- SamplingParams -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 0}, "n=0"),
        ({"n": 1.5}, "n=1.5"),
        ({"max_tokens": -1}, "max_tokens=-1: must be an integer >= 0"),
        ({"max_tokens": None}, "max_tokens=None"),
        ({"temperature": -0.1}, "temperature=-0.1"),
        ({"temperature": math.nan}, "temperature=nan"),
        ({"temperature": math.inf}, "temperature=inf"),
        ({"temperature": "hot"}, "temperature='hot'"),
        ({"top_k": -2}, "top_k=-2"),
        ({"top_k": 2.5}, "top_k=2.5"),
        ({"top_p": 0.0}, r"top_p=0.0: must be in \(0, 1\]"),
        ({"top_p": 1.01}, "top_p=1.01"),
        ({"min_p": -0.1}, "min_p=-0.1"),
        ({"min_p": 1.5}, r"min_p=1.5: must be in \[0, 1\]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty=0.0"),
        ({"presence_penalty": 2.5}, r"presence_penalty=2.5: must be in \[-2, 2\]"),
        ({"frequency_penalty": -3}, "frequency_penalty=-3"),
        ({"seed": "7"}, "seed='7'"),
        ({"seed": 1.0}, "seed=1.0"),
        ({"stop": [""]}, r"stop=\('',\)"),
        ({"stop": ["ok", 3]}, "stop="),
        ({"stop_token_ids": [-1]}, r"stop_token_ids=\(-1,\)"),
        ({"stop": 5}, "stop=5: must be a string or a list of strings"),
        ({"stop_token_ids": 5}, "stop_token_ids=5: must be a list of token ids"),
        ({"stop_token_ids": "12"}, "stop_token_ids='12'"),
        ({"temperature": 1e300}, r"temperature=1e\+300: must be a number in \[0, 3.4e\+38\]"),
        ({"repetition_penalty": 1e39}, "repetition_penalty=1e\\+39"),
        ({"logprobs": 21}, r"logprobs=21: must be None or an integer in \[0, 20\]"),
        ({"logprobs": -1}, "logprobs=-1"),
        ({"ignore_eos": "yes"}, "ignore_eos='yes'"),
        ({"skip_special_tokens": 0}, "skip_special_tokens=0"),
    ],
)
def test_sampling_params_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match="SamplingParams." + message):
        SamplingParams(**kwargs)


def test_sampling_params_normalizes_and_is_frozen():
    p = SamplingParams(stop="###", stop_token_ids=[3, 4], top_k=0, seed=-5, temperature=0)
    assert p.stop == ("###",) and p.stop_token_ids == (3, 4) and p.is_greedy
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None, stop_token_ids=None).stop == ()
    assert not SamplingParams().uses_penalties and SamplingParams(presence_penalty=0.1).uses_penalties
    assert hash(p) == hash(SamplingParams(stop=("###",), stop_token_ids=(3, 4), top_k=0, seed=-5, temperature=0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0
    assert max_top_logprobs([SamplingParams(logprobs=5), SamplingParams(), p]) == 5


# --- sampling -------------------------------------------------------------------------------------
def arrays_for(params, num_generated=None, **kw):
    num_generated = num_generated or [0] * len(params)
    return make_sampling_arrays(params, num_generated, batch_size=kw.pop("batch_size", len(params)), **kw)


def test_greedy_rows_take_the_argmax_exactly():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(8, 1000)).astype(np.float32)
    params = [SamplingParams(temperature=t) for t in (0.0, 1e-6, 0.0, 0.0)]
    out = sample_jit(logits, arrays_for(params, batch_size=8), 0)
    np.testing.assert_array_equal(np.asarray(out.tokens), logits.argmax(-1))
    assert out.tokens.dtype == jnp.int32 and out.top_ids.shape == (8, 0)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    rng = np.random.default_rng(2)
    vocab = 500
    row = rng.normal(size=vocab).astype(np.float32)  # a wide distribution: argmax is not a given
    mine = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    others = [SamplingParams(temperature=0.7, seed=s) for s in range(3)]

    def draw(position, other_logits, num_generated):
        logits = np.array(other_logits)
        logits[position] = row
        params = list(others)
        params.insert(position, mine)
        counts = [5, 9, 2]
        counts.insert(position, num_generated)
        return int(sample_jit(logits, arrays_for(params[:4], counts), 0).tokens[position])

    first = draw(0, rng.normal(size=(4, vocab)).astype(np.float32), 7)
    assert first == draw(0, rng.normal(size=(4, vocab)).astype(np.float32), 7)
    assert first == draw(3, rng.normal(size=(4, vocab)).astype(np.float32), 7)
    assert first == draw(2, np.zeros((4, vocab), np.float32), 7)
    # the stream moves on with each generated token, and differs between seeds
    stream = {draw(1, np.zeros((4, vocab), np.float32), g) for g in range(8)}
    assert len(stream) > 4
    tokens = sample_jit(
        np.tile(row, (8, 1)),
        arrays_for([SamplingParams(seed=s) for s in (1, 2, 3, 4, 2**32 + 1, 2**33 + 1, -1, 2**64 - 1)]),
        0,
    ).tokens
    assert len(set(np.asarray(tokens).tolist())) > 4


def test_samples_follow_the_filtered_distribution():
    logits = np.log(np.array([0.4, 0.25, 0.2, 0.1, 0.05], np.float32))
    n = 4000
    params = [SamplingParams(temperature=1.0, top_k=3, seed=99)] * n
    out = sample_jit(np.tile(logits, (n, 1)), arrays_for(params, list(range(n))), 0)
    counts = np.bincount(np.asarray(out.tokens), minlength=5)
    assert counts[3] == counts[4] == 0
    expected = np.array([0.4, 0.25, 0.2]) / 0.85
    np.testing.assert_allclose(counts[:3] / n, expected, atol=0.03)
    # temperature 0.5 sharpens towards p^2
    params = [SamplingParams(temperature=0.5, seed=99)] * n
    counts = np.bincount(
        np.asarray(sample_jit(np.tile(logits, (n, 1)), arrays_for(params, list(range(n))), 0).tokens), minlength=5
    )
    sharp = np.exp(2 * logits) / np.exp(2 * logits).sum()
    np.testing.assert_allclose(counts / n, sharp, atol=0.03)


def test_logprobs_are_log_softmax_of_the_raw_logits():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(4, 64)).astype(np.float32) * 3
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(seed=1, temperature=2.0),
        SamplingParams(seed=2, top_k=2, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, presence_penalty=2.0),
    ]
    arrays = arrays_for(
        params, [0, 0, 1, 1], prompt_token_ids=[[1]] * 4, output_token_ids=[[], [], [5], [int(logits[3].argmax())]]
    )
    out = sample_jit(logits, arrays, 5)
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    tokens = np.asarray(out.tokens)
    np.testing.assert_allclose(np.asarray(out.logprobs), ref[np.arange(4), tokens], atol=1e-5)
    order = np.argsort(-ref, axis=-1)[:, :5]
    np.testing.assert_array_equal(np.asarray(out.top_ids), order)
    np.testing.assert_allclose(np.asarray(out.top_logprobs), np.take_along_axis(ref, order, -1), atol=1e-5)
    # the presence penalty moved the greedy row off its raw argmax
    assert tokens[3] != logits[3].argmax()


def reference_penalties(logits, prompt, output, rep, presence, frequency):
    logits = logits.astype(np.float64).copy()
    for t in set(prompt) | set(output):
        logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
    for t in set(output):
        logits[t] -= frequency * output.count(t) + presence
    return logits


def test_penalties_match_numpy():
    rng = np.random.default_rng(4)
    batch, vocab = 6, 30
    logits = rng.normal(size=(batch, vocab)).astype(np.float32) * 2
    prompts = [list(rng.integers(0, vocab, size=rng.integers(1, 12))) for _ in range(batch)]
    outputs = [list(rng.integers(0, vocab, size=rng.integers(0, 10))) for _ in range(batch)]
    knobs = [(1.3, 0.0, 0.0), (1.0, 0.5, 0.0), (1.0, 0.0, 0.7), (0.8, -1.0, 1.5), (1.0, 0.0, 0.0), (2.0, 2.0, -2.0)]
    params = [SamplingParams(repetition_penalty=r, presence_penalty=p, frequency_penalty=f) for r, p, f in knobs]
    arrays = arrays_for(
        params,
        [len(o) for o in outputs],
        seeds=[0] * batch,
        prompt_token_ids=prompts,
        output_token_ids=outputs,
        batch_size=8,
    )
    longest = max(len(prompts[i]) * (knobs[i][0] != 1) + len(outputs[i]) for i in range(batch))
    assert arrays.history.token_ids.shape == (8, max(16, 1 << (longest - 1).bit_length()))
    got = np.asarray(jax.jit(apply_penalties)(np.pad(logits, ((0, 2), (0, 0))), arrays))
    for i, (r, p, f) in enumerate(knobs):
        want = reference_penalties(logits[i], prompts[i], outputs[i], r, p, f)
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6, err_msg=f"row {i}")
    np.testing.assert_array_equal(got[4], logits[4])  # penalties off: untouched


def test_make_sampling_arrays_pads_and_checks():
    params = [SamplingParams(seed=2**40 + 7, top_k=-1, temperature=0.5), SamplingParams(temperature=0)]
    a = make_sampling_arrays(params, [3, 0], batch_size=4)
    assert a.seeds.tolist() == [[7, 256], [0, 0], [0, 0], [0, 0]]
    assert a.temperature.tolist() == [0.5, 0.0, 0.0, 0.0] and a.top_k.tolist() == [0, 0, 0, 0]
    assert a.num_generated.tolist() == [3, 0, 0, 0] and a.history is None
    assert make_sampling_arrays(params, [0, 0], batch_size=2, history_len=8).history.token_ids.shape == (2, 8)
    with pytest.raises(ValueError, match="pass seeds="):
        make_sampling_arrays([SamplingParams()], [0], batch_size=1)
    with pytest.raises(ValueError, match="3 params and 3 counts for batch_size=2"):
        make_sampling_arrays([SamplingParams(seed=1)] * 3, [0] * 3, batch_size=2)
    with pytest.raises(ValueError, match="penalties need output_token_ids"):
        make_sampling_arrays([SamplingParams(seed=1, frequency_penalty=1.0)], [0], batch_size=1)
    with pytest.raises(ValueError, match="history_len=2 is shorter than a row's 3 penalty tokens"):
        make_sampling_arrays(
            [SamplingParams(seed=1, repetition_penalty=1.1)],
            [1],
            batch_size=1,
            prompt_token_ids=[[1, 2]],
            output_token_ids=[[3]],
            history_len=2,
        )


def test_new_option_values_do_not_recompile():
    f = jax.jit(lambda logits, arrays: sample(logits, arrays, 0))  # a cache of its own
    logits = np.zeros((4, 32), np.float32)
    for params in (
        [SamplingParams(seed=1)] * 4,
        [SamplingParams(seed=2, top_k=3, top_p=0.5, min_p=0.1, temperature=0.3)] * 4,
        [SamplingParams(temperature=0)] * 2,
    ):
        f(logits, make_sampling_arrays(params, [1] * len(params), batch_size=4))
    assert f._cache_size() == 1
    assert isinstance(make_sampling_arrays([SamplingParams(seed=1)], [0], batch_size=1), SamplingArrays)


# --- with the scheduler ---------------------------------------------------------------------------
def fake_logits(seq, vocab=64):
    """A stand-in model: the next-token logits depend only on the sequence's own tokens."""
    rng = np.random.default_rng([len(seq.token_ids)] + seq.token_ids[-3:])
    return rng.normal(size=vocab).astype(np.float32) * 2


def generate(requests, num_pages, batch_size=8):
    """Runs requests (id, prompt, params) through Scheduler + sampler; returns their outputs."""
    from jaxinfer.core.scheduler import Scheduler
    from jaxinfer.kv import KVCacheManager
    from jaxinfer.sampling.arrays import sampling_arrays_for_sequences

    sched = Scheduler(
        KVCacheManager(num_pages, 4),
        max_num_batched_tokens=16,
        max_num_seqs=batch_size,
        max_model_len=64,
        seed=len(requests),
    )
    seqs = {rid: sched.add_request(rid, prompt, p) for rid, prompt, p in requests}
    preempted = 0
    while sched.has_unfinished():
        plan = sched.schedule()
        preempted += len(plan.preempted)
        logits = np.zeros((batch_size, 64), np.float32)
        for i, e in enumerate(plan.seqs):
            logits[i] = fake_logits(e.seq)
        arrays = sampling_arrays_for_sequences([e.seq for e in plan.seqs], batch_size, history_len=64)
        sched.update(plan, np.asarray(sample_jit(logits, arrays, 0).tokens))
    assert sched.kv_cache.num_free_pages == sched.kv_cache.num_usable_pages
    return {rid: [s.output_token_ids for s in ss] for rid, ss in seqs.items()}, preempted


def test_seeded_request_gives_the_same_tokens_alone_or_in_a_crowd_with_preemption():
    mine = ("mine", [1, 2, 3, 4, 5, 6], SamplingParams(n=2, max_tokens=12, seed=7, top_p=0.9, frequency_penalty=0.5))
    alone, _ = generate([mine], num_pages=32)
    crowd = [(f"r{i}", [i, 9, 9, i, 3][: 1 + i % 5], SamplingParams(max_tokens=10, temperature=0.8)) for i in range(6)]
    together, preempted = generate(crowd[:3] + [mine] + crowd[3:], num_pages=12)
    assert preempted > 0
    assert together["mine"] == alone["mine"]
    assert alone["mine"][0] != alone["mine"][1]  # the two samples draw different streams
