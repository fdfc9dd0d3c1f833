"""The reference against a dense float64 numpy oracle, and the KV write on its own."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.reference import ragged_paged_attention_reference, write_kv
from rpa_cases import dense_oracle, make_case

CASES = {
    "mixed": (dict(q_lens=[5, 1, 20, 1, 9], kv_lens=[40, 30, 20, 1, 9], group=3), {}),
    "window_cap": (dict(q_lens=[3, 12], kv_lens=[50, 12], page_size=8),
                   dict(sliding_window=7, soft_cap=2.0, sm_scale=0.5)),
    "int8": (dict(q_lens=[4, 1], kv_lens=[20, 33], cache_dtype=jnp.int8), {}),
    "fp8": (dict(q_lens=[4, 1], kv_lens=[20, 33], cache_dtype=jnp.float8_e4m3fn), {}),
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
