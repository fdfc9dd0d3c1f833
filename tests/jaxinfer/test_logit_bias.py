"""logit_bias: SamplingParams validation, the fixed-width SamplingArrays rows, and the in-jit bias
(after the penalties, before the structured-output mask, greedy rows included)."""

import copy
import dataclasses
import math
import pickle

import jax
import numpy as np
import pytest

from jaxinfer.sampling import MAX_LOGIT_BIAS, SamplingParams
from jaxinfer.sampling.arrays import make_sampling_arrays
from jaxinfer.sampling.params import check_logit_bias_vocab, logit_bias_from_json
from jaxinfer.sampling.sampler import sample

sample_jit = jax.jit(sample, static_argnums=2)


# --- SamplingParams -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bias, message",
    [
        ({-1: 1.0}, r"logit_bias\[-1\]: a token id must be an integer >= 0"),
        ({"5": 1.0}, r"logit_bias\['5'\]: a token id"),
        ({1.5: 1.0}, r"logit_bias\[1.5\]"),
        ({True: 1.0}, r"logit_bias\[True\]"),
        ({5: 100.5}, r"logit_bias\[5\]=100.5: must be a number in \[-100, 100\]"),
        ({5: -101}, r"logit_bias\[5\]=-101"),
        ({5: math.nan}, r"logit_bias\[5\]=nan"),
        ({5: math.inf}, r"logit_bias\[5\]=inf"),
        ({5: "1"}, r"logit_bias\[5\]='1'"),
        ({5: None}, r"logit_bias\[5\]=None"),
        ([5, 1.0], r"logit_bias=\[5, 1.0\]: must be a dict"),
        ({i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}, "logit_bias: 301 tokens; at most 300"),
    ],
)
def test_bad_logit_bias_is_named(bias, message):
    with pytest.raises(ValueError, match="SamplingParams." + message):
        SamplingParams(logit_bias=bias)


def test_logit_bias_is_checked_frozen_and_hashable():
    p = SamplingParams(logit_bias={np.int64(7): 5, 3: -100.0, 9: 100})
    assert p.logit_bias == {7: 5.0, 3: -100.0, 9: 100.0} and all(type(t) is int for t in p.logit_bias)
    assert SamplingParams(logit_bias={}).logit_bias is None and SamplingParams().logit_bias is None
    assert len(SamplingParams(logit_bias={i: 0.5 for i in range(MAX_LOGIT_BIAS)}).logit_bias) == 300
    with pytest.raises(TypeError, match="read-only"):
        p.logit_bias[7] = 50.0
    with pytest.raises(TypeError, match="read-only"):
        p.logit_bias.update({1: 2.0})
    assert hash(p) == hash(SamplingParams(logit_bias={9: 100, 7: 5.0, 3: -100}))
    assert pickle.loads(pickle.dumps(p)) == p and copy.deepcopy(p) == p
    assert dataclasses.replace(p, max_tokens=3).logit_bias == p.logit_bias
    with pytest.raises(ValueError, match=r"logit_bias\[1\]=200"):
        dataclasses.replace(p, logit_bias={1: 200})


def test_logit_bias_from_json_and_the_vocabulary_check():
    assert logit_bias_from_json({"50256": -100, "7": 2.5, 8: 1}) == {50256: -100, 7: 2.5, 8: 1}
    assert logit_bias_from_json(None) is None
    with pytest.raises(ValueError, match=r"^logit_bias=\[5, 1\]: must be an object of token id -> bias"):
        logit_bias_from_json([5, 1])
    for key in ("abc", "1.5", "", " 5", "0x10"):
        with pytest.raises(ValueError, match=rf"^logit_bias\[{key!r}\]: keys must be token ids"):
            logit_bias_from_json({key: 1.0})
    with pytest.raises(ValueError, match=r"^--logit-bias\['x'\]"):
        logit_bias_from_json({"x": 1.0}, "--logit-bias")
    with pytest.raises(ValueError, match=r"logit_bias\[-3\]"):  # negative ids: SamplingParams says so
        SamplingParams(logit_bias=logit_bias_from_json({"-3": 1.0}))
    check_logit_bias_vocab(SamplingParams(logit_bias={49151: 1.0}), 49152)
    check_logit_bias_vocab(SamplingParams(), 49152)
    with pytest.raises(
        ValueError,
        match=r"logit_bias\[49152\]: token ids out of the vocabulary "
        r"\[0, 49152\): \[49152, 60000\]",
    ):
        check_logit_bias_vocab(SamplingParams(logit_bias={60000: 1.0, 3: 1.0, 49152: -1.0}), 49152)


# --- arrays ---------------------------------------------------------------------------------------
def test_bias_rows_are_packed_and_fixed_width():
    params = [SamplingParams(temperature=0, logit_bias={9: 2.5, 4: -100}), SamplingParams(temperature=0)]
    a = make_sampling_arrays(params, [0, 0], batch_size=4)
    assert a.bias_ids.shape == a.bias_values.shape == (4, MAX_LOGIT_BIAS)
    assert a.bias_ids.dtype == np.int32 and a.bias_values.dtype == np.float16
    assert a.bias_ids[0, :3].tolist() == [9, 4, -1] and a.bias_values[0, :2].tolist() == [2.5, -100.0]
    assert (a.bias_ids[1:] == -1).all() and (a.bias_values[1:] == 0).all()  # unbiased and padding rows


# --- the sampler ----------------------------------------------------------------------------------
def logits_for(batch, vocab=64, seed=0):
    return np.random.default_rng(seed).normal(size=(batch, vocab)).astype(np.float32) * 2


def tokens_of(logits, params, num_generated=None, **kw):
    arrays = make_sampling_arrays(params, num_generated or [0] * len(params), batch_size=len(logits), **kw)
    return np.asarray(sample_jit(logits, arrays, 0).tokens)


def test_plus_100_forces_a_token_greedy_or_sampled():
    logits = logits_for(8)
    forced = [int(np.argmin(row)) for row in logits]  # the least likely token of each row
    params = [
        SamplingParams(temperature=0, logit_bias={forced[0]: 100}),
        *[
            SamplingParams(temperature=t, top_p=p, seed=i, logit_bias={forced[i]: 100})
            for i, (t, p) in enumerate(
                [(1.0, 1.0), (1.5, 0.9), (0.7, 1.0), (2.0, 0.5), (1.0, 1.0), (1.0, 1.0), (0.3, 1.0)], start=1
            )
        ],
    ]
    for g in range(5):  # several draws of each row's stream
        assert tokens_of(logits, params, [g] * 8).tolist() == forced


def test_minus_100_excludes_the_argmax():
    logits = logits_for(2, vocab=8)
    logits[1] = [3.0, 2.9, 2.8, 0, 0, 0, 0, 0]  # a flat top: sampling would pick token 0 often
    top = logits.argmax(-1)
    greedy = SamplingParams(temperature=0, logit_bias={int(top[0]): -100})
    second = np.argsort(-logits[0])[1]
    assert tokens_of(logits[:1], [greedy]).tolist() == [second]
    sampled = SamplingParams(temperature=1.0, seed=3, logit_bias={0: -100})
    draws = [tokens_of(logits[1:], [sampled], [g])[0] for g in range(64)]
    assert 0 not in draws and {1, 2} <= set(draws)


def test_unbiased_rows_are_untouched_in_a_mixed_batch():
    logits = logits_for(6, vocab=300)
    plain = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.8, top_k=20, seed=2),
    ]
    biased = [
        SamplingParams(temperature=0, logit_bias={i: 50.0 for i in range(0, 300, 3)}),
        SamplingParams(temperature=1.0, seed=4, logit_bias={int(logits[4].argmax()): -100}),
        SamplingParams(temperature=0, logit_bias={int(logits[5].argmin()): 100}),
    ]
    alone = tokens_of(logits[[0, 2, 4]], plain)
    mixed = tokens_of(logits[[0, 1, 2, 3, 4, 5]], [plain[0], biased[0], plain[1], biased[1], plain[2], biased[2]])
    assert mixed[[0, 2, 4]].tolist() == alone.tolist()
    assert mixed[1] % 3 == 0 and mixed[5] == logits[5].argmin()


def test_greedy_matches_numpy_argmax_of_biased_logits():
    rng = np.random.default_rng(5)
    logits = logits_for(16, vocab=100, seed=5)
    params, want = [], []
    for row in logits:
        ids = rng.choice(100, size=rng.integers(1, 40), replace=False)
        values = rng.integers(-64, 64, size=len(ids)) / 16  # exact in float16
        params.append(SamplingParams(temperature=0, logit_bias=dict(zip(ids.tolist(), values.tolist()))))
        biased = row.astype(np.float64).copy()
        biased[ids] += values
        want.append(int(biased.argmax()))
    assert tokens_of(logits, params).tolist() == want


def test_bias_comes_after_penalties_and_before_the_allowed_mask():
    logits = np.full((1, 64), -5.0, np.float32)
    logits[0, :2] = [2.0, 1.5]
    # token 0 was seen: repetition 4 makes it 0.5; +1.2 after that is 1.7 > 1.5 (before: 0.8 < 1.5)
    p = SamplingParams(temperature=0, repetition_penalty=4.0, logit_bias={0: 1.2})
    assert tokens_of(logits, [p], prompt_token_ids=[[0]], output_token_ids=[[]]).tolist() == [0]
    # a grammar that allows only token 1 wins over +100 on token 0
    arrays = make_sampling_arrays(
        [SamplingParams(temperature=0, logit_bias={0: 100})], [0], batch_size=1, vocab_size=64
    )
    arrays.allowed[0] = 0
    arrays.allowed[0, 0] = 1 << 1
    assert np.asarray(sample_jit(logits, arrays, 0).tokens).tolist() == [1]


def test_logprobs_stay_those_of_the_raw_logits_and_nothing_recompiles():
    logits = logits_for(2, vocab=32)
    f = jax.jit(lambda x, arrays: sample(x, arrays, 3))  # a cache of its own
    raw = f(logits, make_sampling_arrays([SamplingParams(temperature=0, logprobs=3)] * 2, [0, 0], batch_size=2))
    forced = int(logits[0].argmin())
    out = f(
        logits,
        make_sampling_arrays(
            [SamplingParams(temperature=0, logprobs=3, logit_bias={forced: 100})] * 2, [0, 0], batch_size=2
        ),
    )
    assert np.asarray(out.tokens).tolist() == [forced, forced]
    np.testing.assert_array_equal(np.asarray(out.top_ids), np.asarray(raw.top_ids))
    log_softmax = logits[0] - np.log(np.exp(logits[0].astype(np.float64)).sum())
    assert float(out.logprobs[0]) == pytest.approx(log_softmax[forced], abs=1e-5)
    assert f._cache_size() == 1


# --- command line and batch lines -----------------------------------------------------------------
def test_command_line_flag_and_batch_lines():
    from types import SimpleNamespace

    from jaxinfer.cli import build_parser
    from jaxinfer.cli.args import sampling_params
    from jaxinfer.rows import parse_line

    def bias(*flags, command=("generate", "hi")):
        return sampling_params(build_parser().parse_args([*command, *flags])).logit_bias

    assert bias() is None
    assert bias("--logit-bias", '{"123": 5.0, "7": -100}') == {123: 5.0, 7: -100.0}
    assert bias("--logit-bias", '{"3": 1}', command=("chat",)) == {3: 1.0}
    assert bias("--logit-bias", '{"3": 1}', command=("batch", "--input", "in.jsonl")) == {3: 1.0}
    for flag, message in (
        ("{3: 1}", r"--logit-bias '\{3: 1\}': not valid JSON"),
        ("[3, 1]", r"--logit-bias=\[3, 1\]: must be an object of token id -> bias"),
        ('{"x": 1}', r"--logit-bias\['x'\]: keys must be token ids"),
        ('{"3": 200}', r"SamplingParams.logit_bias\[3\]=200"),
    ):
        with pytest.raises(ValueError, match=message):
            bias("--logit-bias", flag)

    def line(text, defaults=None, llm=None):
        return parse_line(text, 2, defaults or SamplingParams(), llm=llm)[2].logit_bias

    assert line('{"prompt": "hi", "logit_bias": {"5": -100}}') == {5: -100.0}
    assert line('{"prompt": "hi", "logit_bias": {"5": 2}}', SamplingParams(logit_bias={1: 1})) == {5: 2.0}
    assert line('{"prompt": "hi"}', SamplingParams(logit_bias={1: 1})) == {1: 1.0}  # the command line's
    with pytest.raises(ValueError, match=r"^line 2: logit_bias\['x'\]: keys must be token ids"):
        line('{"prompt": "hi", "logit_bias": {"x": 1}}')
    with pytest.raises(ValueError, match=r"^line 2: SamplingParams.logit_bias\[5\]=-101"):
        line('{"prompt": "hi", "logit_bias": {"5": -101}}')
    llm = SimpleNamespace(engine=SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(vocab_size=10))))
    with pytest.raises(ValueError, match=r"^line 2: SamplingParams.logit_bias\[10\]: token ids out of the vocab"):
        line('{"prompt": "hi", "logit_bias": {"10": 1}}', llm=llm)


# --- through the engine ---------------------------------------------------------------------------
def test_the_engine_biases_steps_and_decode_windows_without_compiling():
    from testpaths import FIXTURES

    from jaxinfer.llm import LLM

    llm = LLM(
        str(FIXTURES / "hf" / "llama3"),
        "float32",
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        token_buckets=(8, 32),
        num_pages=32,
    )
    compiled = llm.engine.worker.num_compiled()
    vocab = llm.engine.model.config.vocab_size
    prompt = [1, 2, 3, 4, 5]

    def run(**kw):
        return SamplingParams(max_tokens=12, ignore_eos=True, **kw)

    plain = llm.generate(prompt, run(temperature=0), use_tqdm=False)[0].outputs[0].token_ids
    forced = next(t for t in range(vocab - 1, 0, -1) if t not in plain)
    outs = llm.generate(
        [prompt] * 4,
        [
            run(temperature=0, logit_bias={forced: 100}),
            run(temperature=0.9, seed=1, logit_bias={forced: 100}),
            run(temperature=0, logit_bias={plain[0]: -100}),
            run(temperature=0),
        ],
        use_tqdm=False,
    )
    tokens = [o.outputs[0].token_ids for o in outs]
    assert tokens[0] == tokens[1] == [forced] * 12  # prefill step, single steps and decode windows
    assert tokens[2][0] != plain[0] and tokens[3] == plain  # the unbiased row is untouched
    assert llm.engine.worker.num_compiled() == compiled
    with pytest.raises(ValueError, match=rf"logit_bias\[{vocab}\]: token ids out of the vocabulary"):
        llm.generate(prompt, run(logit_bias={vocab: 1.0}), use_tqdm=False)
