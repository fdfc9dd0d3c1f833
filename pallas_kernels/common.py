"""Pieces shared by the Pallas kernels: argument checks, KV scales, token validity.

The helpers here describe the ragged batch to a kernel, check that a kernel can take a shape
before anything is lowered, and hold the online-softmax math both kernels trace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

# A Pallas memory reference: a kernel's input, output or scratch buffer (indexed, loaded, stored).
type Ref = Any

# Finite stand-in for -inf in kernels: exp(MASK - MASK) is 1, not NaN, and any real score wipes
# what a fully masked block added (exp(MASK - real) == 0 exactly in float32).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


# Running (max, sum, acc) of an online softmax.
SoftmaxCarry = tuple[jax.Array, jax.Array, jax.Array]
# A kernel's limits: unsupported_reason(q, kv_cache, page_indices) -> why not, or None.
ReasonFn = Callable[[jax.Array, jax.Array, jax.Array], str | None]


class UnsupportedShape(ValueError):
    """A kernel cannot take these shapes/options; the reason names the offending value."""


def is_quantized(dtype: DTypeLike) -> bool:
    return jnp.dtype(dtype).itemsize == 1


def mesh_device() -> jax.sharding.AbstractDevice | None:
    """The device kind of the current mesh (None without one): what a step is traced for, which
    may be another platform's (TPU chips of a deviceless topology, compiled ahead of time)."""
    return getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)


def check_contract(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_cache: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    k_scale: jax.Array | None,
    v_scale: jax.Array | None,
) -> None:
    """Shape/dtype checks every implementation shares; raises ValueError naming the bad value."""
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or kv_cache.ndim != 4:
        raise ValueError(
            f"expected q, k, v 3-D and kv_cache 4-D; got q{q.shape} k{k.shape} v{v.shape} kv_cache{kv_cache.shape}"
        )
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, two_hkv, cache_d = kv_cache.shape
    num_kv_heads = two_hkv // 2
    if two_hkv % 2 or cache_d != head_dim:
        raise ValueError(f"kv_cache shape {kv_cache.shape} does not match q {q.shape}")
    if k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k {k.shape} / v {v.shape} must be {(num_tokens, num_kv_heads, head_dim)}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    num_seqs_max = page_indices.shape[0]
    if kv_lens.shape != (num_seqs_max,) or cu_q_lens.shape != (num_seqs_max + 1,):
        raise ValueError(
            f"kv_lens {kv_lens.shape} / cu_q_lens {cu_q_lens.shape} do not match page_indices {page_indices.shape}"
        )
    if jnp.size(num_seqs) != 1:
        raise ValueError(f"num_seqs must hold one value; got shape {jnp.shape(num_seqs)}")
    if is_quantized(kv_cache.dtype) and (k_scale is None or v_scale is None):
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} is quantized: k_scale and v_scale are required")


def validate_kernel_call(
    kernel_name: str,
    unsupported_reason: ReasonFn,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_cache: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    k_scale: jax.Array | None,
    v_scale: jax.Array | None,
    sliding_window: int | None,
    soft_cap: float | None,
) -> None:
    """A kernel's entry check: the contract, the options, then the kernel's own limits
    (`unsupported_reason(q, kv_cache, page_indices)`), raising UnsupportedShape for those."""
    check_contract(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale)
    check_options(sliding_window, soft_cap)
    reason = unsupported_reason(q, kv_cache, page_indices)
    if reason is not None:
        raise UnsupportedShape(f"{kernel_name} cannot take {reason}")


def dtype_mismatch(q: jax.Array, kv_cache: jax.Array, supported: Sequence[DTypeLike]) -> str | None:
    """Why q / kv_cache dtypes don't suit a kernel that takes `supported` query dtypes, or None."""
    if q.dtype not in supported:
        names = " or ".join(str(jnp.dtype(d)) for d in supported)
        return f"q dtype {q.dtype} (want {names})"
    if kv_cache.dtype != q.dtype and not is_quantized(kv_cache.dtype):
        return f"kv_cache dtype {kv_cache.dtype} with q dtype {q.dtype}"
    return None


def check_options(sliding_window: int | None, soft_cap: float | None) -> None:
    if sliding_window is not None and (int(sliding_window) != sliding_window or sliding_window < 1):
        raise ValueError(f"sliding_window={sliding_window!r} must be None or a positive integer")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap={soft_cap!r} must be None or a positive number")


def kv_scales(kv_cache: jax.Array, k_scale: jax.Array | None, v_scale: jax.Array | None) -> jax.Array:
    """float32 [Hkv, 2]: (k_scale, v_scale) per kv head; ones for an unquantized cache."""
    num_kv_heads = kv_cache.shape[2] // 2
    if not is_quantized(kv_cache.dtype):
        return jnp.ones((num_kv_heads, 2), jnp.float32)
    k_scale = jnp.broadcast_to(jnp.asarray(k_scale, jnp.float32).reshape(-1), (num_kv_heads,))
    v_scale = jnp.broadcast_to(jnp.asarray(v_scale, jnp.float32).reshape(-1), (num_kv_heads,))
    return jnp.stack([k_scale, v_scale], axis=1)


def scalar_num_seqs(num_seqs: jax.Array | int) -> jax.Array:
    """i32[1]: the real sequence count, from an array of one value (or a Python int)."""
    return jnp.asarray(num_seqs, jnp.int32).reshape(-1)[:1]


def real_q_lens(cu_q_lens: jax.Array, num_seqs: jax.Array) -> jax.Array:
    """i32[S]: query tokens per sequence, 0 for padding sequences (s >= num_seqs)."""
    num_seqs_max = cu_q_lens.shape[0] - 1
    real = jnp.arange(num_seqs_max, dtype=jnp.int32) < scalar_num_seqs(num_seqs)[0]
    return jnp.where(real, cu_q_lens[1:] - cu_q_lens[:-1], 0)


def bucket_of(edges: jax.Array, x: jax.Array) -> jax.Array:
    """i32: how many of the sorted `edges` are <= each x (searchsorted, side="right"). One
    comparison and sum for the batch's small searches (tokens or work items x sequences): the
    default search is a loop, which costs a few kernel launches per step of it on a GPU."""
    method = "compare_all" if edges.size * x.size <= 1 << 22 else "scan"
    return jnp.searchsorted(edges, x, side="right", method=method).astype(jnp.int32)


def token_positions(
    kv_lens: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array | int, num_tokens: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per query token: (sequence index, absolute position, is-real-token), each [T]."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    num_seqs = jnp.asarray(num_seqs).reshape(-1)[0]
    seq = bucket_of(cu_q_lens[1:], t)
    seq = jnp.minimum(seq, kv_lens.shape[0] - 1)
    valid = t < cu_q_lens[num_seqs]
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (t - cu_q_lens[seq])
    return seq, jnp.where(valid, pos, 0), valid


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


# --- in-kernel math shared by the GPU and TPU kernels (traced inside pallas_call) ---


def block_scores(
    q: jax.Array, k: jax.Array, *, scale: float | jax.Array, soft_cap: float | None, precision: lax.Precision | None
) -> jax.Array:
    """q [M, D] . k [N, D] -> float32 scores [M, N], scaled (and soft-capped)."""
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)
    s = s * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    return s


def online_softmax_update(
    carry: SoftmaxCarry, s: jax.Array, v: jax.Array, *, precision: lax.Precision | None, keepdims: bool
) -> SoftmaxCarry:
    """One KV block of the float32 online softmax.

    carry (m, l, acc): running max and sum ([M] or [M, 1] with keepdims) and acc [M, D];
    s [M, N]: scores with masked entries already MASK_VALUE; v [N, D]: zero where unwritten."""
    m, l, acc = carry
    col = (lambda x: x) if keepdims else (lambda x: x[:, None])
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=keepdims))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - col(m_new))
    l = alpha * l + jnp.sum(p, axis=1, keepdims=keepdims)
    pv = lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )
    return m_new, l, col(alpha) * acc + pv
