"""Top-k, top-p and min-p masks (sampler.mask_logits) against a float64 reference computed token
by token: the thresholds are found by bisecting the logits' order, with no sort."""

import math

import jax
import numpy as np
import pytest

from jaxinfer.sampling.sampler import mask_logits

mask_jit = jax.jit(mask_logits)


def reference_mask(logits, top_k, top_p, min_p):
    """Which tokens survive, computed token by token in float64."""
    logits = logits.astype(np.float64)
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    kept = set(order)
    if 0 < top_k < len(logits):
        kth = logits[order[top_k - 1]]
        kept = {i for i in kept if logits[i] >= kth}
    if top_p < 1:
        top = max(logits[i] for i in kept)
        z = sum(math.exp(logits[i] - top) for i in kept)
        mass, last = 0.0, None
        for i in order:
            if i in kept and mass < top_p:
                mass += math.exp(logits[i] - top) / z
                last = logits[i]
        kept = {i for i in kept if logits[i] >= last}
    probs = np.exp(logits - logits.max())
    kept = {i for i in kept if probs[i] >= min_p * probs.max()}
    return np.array([i in kept for i in range(len(logits))])


def test_top_k_top_p_min_p_masks_match_numpy():
    rng = np.random.default_rng(0)
    batch, vocab = 64, 40
    logits = rng.normal(size=(batch, vocab)).astype(np.float32) * 2
    logits[::4] = np.round(logits[::4])  # ties at the thresholds
    top_k = rng.choice([0, 0, 1, 3, 10, vocab, vocab + 5], size=batch).astype(np.int32)
    top_p = rng.choice([1.0, 1.0, 0.05, 0.3, 0.75, 0.95], size=batch).astype(np.float32)
    min_p = rng.choice([0.0, 0.0, 0.05, 0.3, 1.0], size=batch).astype(np.float32)
    got = np.isfinite(np.asarray(mask_jit(logits, top_k, top_p, min_p)))
    for row in range(batch):
        want = reference_mask(logits[row], top_k[row], top_p[row], min_p[row])
        np.testing.assert_array_equal(
            got[row], want, err_msg=f"row {row}: k={top_k[row]} p={top_p[row]} min_p={min_p[row]}"
        )
    # kept logits are unchanged
    masked = np.asarray(mask_jit(logits, top_k, top_p, min_p))
    np.testing.assert_array_equal(masked[got], logits[got])
    # all filters off: nothing masked (and the sort is skipped)
    off = mask_jit(logits, np.zeros(batch, np.int32), np.ones(batch, np.float32), np.zeros(batch, np.float32))
    np.testing.assert_array_equal(np.asarray(off), logits)


@pytest.mark.parametrize("seed", [1, 2])
def test_masks_on_a_wide_vocabulary_with_extremes(seed):
    """A vocabulary of 3000 with -inf (masked tokens), -0.0 beside 0.0, huge and tiny logits,
    runs of ties, top_p close to 1 and top_k of 1: the bisection's thresholds are the sorted
    reference's."""
    rng = np.random.default_rng(seed)
    batch, vocab = 12, 3000
    logits = (rng.standard_normal((batch, vocab)) * rng.choice([0.01, 1, 30], size=(batch, 1))).astype(np.float32)
    logits[0, :1000] = -np.inf
    logits[1, ::2] = -0.0
    logits[1, 1::2] = 0.0
    logits[2] = np.round(logits[2] * 2) / 2  # wide runs of ties
    logits[3, :5] = 3e38
    logits[4, 7] = -3e38
    top_k = np.array([0, 5, 100, 3, 1, 2999, 3000, 0, 0, 50, 1, 0], np.int32)
    top_p = np.array([0.9, 1.0, 0.5, 0.3, 1.0, 0.999, 0.99999, 0.01, 0.6, 0.95, 0.2, 1.0], np.float32)
    min_p = np.zeros(batch, np.float32)
    got = np.isfinite(np.asarray(mask_jit(logits, top_k, top_p, min_p)))
    for row in range(batch):
        want = reference_mask(logits[row], top_k[row], top_p[row], 0.0) & np.isfinite(logits[row])
        np.testing.assert_array_equal(got[row], want, err_msg=f"row {row}")


def test_the_masks_compile_without_a_sort():
    """The lowered masks hold no sort (and no top-k) of the vocabulary."""
    logits = np.zeros((4, 1000), np.float32)
    text = mask_jit.lower(logits, np.ones(4, np.int32), np.full(4, 0.5, np.float32), np.zeros(4, np.float32)).as_text()
    assert "sort" not in text and "top_k" not in text and "while" in text
