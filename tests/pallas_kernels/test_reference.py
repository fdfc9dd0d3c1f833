"""The reference against a dense float64 numpy oracle, and the KV write on its own."""

import jax.numpy as jnp
import numpy as np
import pytest
from rpa_cases import dense_oracle, make_case

from pallas_kernels.reference import ragged_paged_attention_reference, write_kv

CASES = {
    "mixed": (dict(q_lens=[5, 1, 20, 1, 9], kv_lens=[40, 30, 20, 1, 9], group=3), {}),
    "window_cap": (
        dict(q_lens=[3, 12], kv_lens=[50, 12], page_size=8),
        dict(sliding_window=7, soft_cap=2.0, sm_scale=0.5),
    ),
    "int8": (dict(q_lens=[4, 1], kv_lens=[20, 33], cache_dtype=jnp.int8), {}),
    "fp8": (dict(q_lens=[4, 1], kv_lens=[20, 33], cache_dtype=jnp.float8_e4m3fn), {}),
    # Decode rows whose contexts span several blocks of the context loop (128 tokens at most),
    # the last one partly filled, on a float and a quantized cache.
    "long_decode": (dict(q_lens=[1, 1, 1], kv_lens=[300, 129, 7], group=3), {}),
    "long_decode_int8": (dict(q_lens=[1, 2], kv_lens=[260, 140], cache_dtype=jnp.int8), {}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_matches_dense_oracle(name):
    case_kw, opts = CASES[name]
    opts = {"sm_scale": 0.125, **opts}
    case = make_case(**case_kw, seed=sorted(CASES).index(name))
    out, cache = ragged_paged_attention_reference(*case.args(), **case.scales(), **opts)
    want = dense_oracle(case, cache, **opts)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=2e-5)


def test_write_kv_writes_exactly_the_new_slots():
    case = make_case(q_lens=[3, 0, 2], kv_lens=[10, 4, 2], page_size=4, pad_tokens=2, seed=5)
    args = case.args()
    cache = np.asarray(write_kv(args[3], args[1], args[2], *args[4:]))
    before = case.kv_cache
    expected = before.copy()
    for s in range(3):
        q0, q1, kv_len = case.cu_q_lens[s], case.cu_q_lens[s + 1], case.kv_lens[s]
        for t in range(q0, q1):
            pos = kv_len - (q1 - q0) + (t - q0)
            page, slot = case.page_indices[s, pos // 4], pos % 4
            expected[page, slot, 0::2] = case.k[t]
            expected[page, slot, 1::2] = case.v[t]
    np.testing.assert_array_equal(cache, expected)  # padding tokens wrote nothing


@pytest.mark.parametrize("cache_dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_quantized_write_stores_x_over_scale_rounded(cache_dtype):
    """int8: round(x / scale) clipped to [-128, 127], so |x - stored * scale| <= scale / 2 inside
    the range; fp8 e4m3: x / scale to the nearest of 3 mantissa bits (relative error <= 2^-4),
    clipped to +-448. K of head h at 2h, V at 2h + 1, each with its own head's scale."""
    case = make_case(q_lens=[3, 2], kv_lens=[9, 2], page_size=4, cache_dtype=cache_dtype, seed=11)
    k_scale = np.array([0.011, 0.023], np.float32)
    v_scale = np.array([0.017, 0.031], np.float32)
    args = case.args()
    cache = write_kv(args[3], args[1], args[2], *args[4:], k_scale=jnp.asarray(k_scale), v_scale=jnp.asarray(v_scale))
    cache = np.asarray(jnp.asarray(cache).astype(jnp.float32))
    scales = np.stack([k_scale, v_scale], 1).reshape(-1)  # [2K]
    for s in range(2):
        q0, q1, kv_len = case.cu_q_lens[s], case.cu_q_lens[s + 1], case.kv_lens[s]
        for t in range(q0, q1):
            pos = kv_len - (q1 - q0) + (t - q0)
            stored = cache[case.page_indices[s, pos // 4], pos % 4]  # [2K, D]
            x = np.stack([case.k[t], case.v[t]], 1).reshape(stored.shape)  # [2K, D]
            scale = np.broadcast_to(scales[:, None], x.shape)
            y = x / scale
            if cache_dtype == jnp.int8:
                np.testing.assert_array_equal(stored, np.clip(np.round(y), -128, 127))
                inside = np.abs(y) <= 127
                error = np.abs(x - stored * scale)
                assert np.all(error[inside] <= scale[inside] / 2 * (1 + 1e-6))
            else:
                inside = (np.abs(y) <= 448) & (np.abs(y) >= 2**-6)  # normal, unclipped
                assert np.all(np.abs(stored - y)[inside] <= 2**-4 * np.abs(y)[inside])
                np.testing.assert_array_equal(stored[np.abs(y) > 448], 448 * np.sign(y[np.abs(y) > 448]))


@pytest.mark.parametrize("num_edges,num_queries", [(9, 40), (2048, 4096)])  # compare, then loop
def test_bucket_of_is_searchsorted_right(num_edges, num_queries):
    """The work lists' sequence search: one comparison for small searches, the loop past 4M
    pairs; both count the sorted edges <= x, repeated edges included."""
    from pallas_kernels.common import bucket_of

    rng = np.random.default_rng(num_edges)
    edges = np.sort(rng.integers(0, 3 * num_edges, num_edges)).astype(np.int32)
    x = rng.integers(-2, 3 * num_edges + 2, num_queries).astype(np.int32)
    got = np.asarray(bucket_of(jnp.asarray(edges), jnp.asarray(x)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.searchsorted(edges, x, side="right"))
