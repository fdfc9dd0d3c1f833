"""Chooses an implementation of ragged paged attention for the current backend."""
from __future__ import annotations

import jax

from pallas_kernels.reference import ragged_paged_attention_reference

IMPLS = ("auto", "reference", "pallas_gpu", "pallas_tpu")


def resolve_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; expected one of {IMPLS}")
    if impl != "auto":
        return impl
    return "reference"


def ragged_paged_attention(
    q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
    *, sm_scale, sliding_window=None, soft_cap=None, k_scale=None, v_scale=None, impl="auto",
):
    """q [T, Hq, D]; k, v [T, Hkv, D]; kv_cache [P, page, 2*Hkv, D] -> (out [T, Hq, D], kv_cache)."""
    impl = resolve_impl(impl)
    kwargs = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                  k_scale=k_scale, v_scale=v_scale)
    args = (q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs)
    if impl == "reference":
        return ragged_paged_attention_reference(*args, **kwargs)
    raise NotImplementedError(f"attention impl {impl!r} is not available on backend {jax.default_backend()!r}")
