"""Plain sampling arrays (SamplingArrays.plain): every row greedy and asking for nothing else, the
decode step's greedy twin samples them with no conditional."""

import jax
import numpy as np

from jaxinfer.sampling import SamplingParams
from jaxinfer.sampling.arrays import fill_defaults, is_plain, make_sampling_arrays, unsent_defaults
from jaxinfer.sampling.sampler import sample

sample_jit = jax.jit(sample, static_argnums=2)


def arrays_for(params, **kw):
    return make_sampling_arrays(params, [0] * len(params), batch_size=kw.pop("batch_size", len(params)), **kw)


def test_plain_arrays_are_every_row_greedy_asking_nothing_else():
    """is_plain: what the runner checks before it runs the greedy twin (no conditional)."""

    def plain(params, grammar=False, **kw):
        arrays = arrays_for(
            params,
            batch_size=4,
            vocab_size=64,
            prompt_token_ids=[[1]] * len(params),
            output_token_ids=[[2]] * len(params),
            **kw,
        )
        return is_plain(unsent_defaults(arrays, grammar))

    greedy = SamplingParams(temperature=0.0)
    assert plain([greedy, greedy])
    assert not plain([greedy, SamplingParams(temperature=0.5, seed=1)])
    assert not plain([greedy, SamplingParams(temperature=0.0, logprobs=1)])
    assert not plain([greedy, SamplingParams(temperature=0.0, logit_bias={3: 1.0})])
    assert not plain([greedy, SamplingParams(temperature=0.0, presence_penalty=0.5)])
    assert not plain([greedy], grammar=True)
    assert not plain([greedy], history_len=16)  # a penalty history of any kind


def test_plain_arrays_sample_as_the_general_sampler_with_no_conditional():
    rng = np.random.default_rng(11)
    logits = rng.normal(size=(6, 300)).astype(np.float32) * 4
    arrays = unsent_defaults(
        arrays_for([SamplingParams(temperature=0.0)] * 5, batch_size=6, vocab_size=300), grammar=False
    )
    general = sample_jit(logits, fill_defaults(arrays, 300), 4)
    plain = sample_jit(logits, arrays.replace(plain=True), 4)
    for name in ("tokens", "logprobs", "top_ids", "top_logprobs"):
        np.testing.assert_array_equal(np.asarray(getattr(plain, name)), np.asarray(getattr(general, name)))
    assert plain.top_ids.shape == (6, 4) and not np.asarray(plain.top_ids).any()
    jaxpr = str(jax.make_jaxpr(sample, static_argnums=2)(logits, arrays.replace(plain=True), 4))
    assert "cond[" not in jaxpr and "sort[" not in jaxpr and "top_k[" not in jaxpr
    assert "cond[" in str(jax.make_jaxpr(sample, static_argnums=2)(logits, fill_defaults(arrays, 300), 4))
