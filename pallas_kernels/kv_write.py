"""Writing a step's new keys and values into the paged KV cache, as every implementation stores them.

    kv_cache: [num_pages, page_size, 2 * Hkv, D]; K of kv head h at index 2h of the third axis,
    V at 2h + 1. An int8 / float8 cache holds x / scale with one float32 scale per kv head for K
    and one for V (`k_scale`, `v_scale` [Hkv]).

`write_kv` scatters the step's K/V into their slots (padding tokens past cu_q_lens[num_seqs]
dropped); the kernels that write inside their own call store the same values (`stored_kv`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from pallas_kernels.common import is_quantized, token_positions


def kv_cache_shape(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
    return (num_pages, page_size, 2 * num_kv_heads, head_dim)


def kv_scale(scale: jax.Array | None) -> jax.Array:
    """The per-head scales an int8 / fp8 cache is read and written with (common.check_contract
    refuses such a cache without them)."""
    if scale is None:
        raise ValueError("an int8 / fp8 KV cache needs its per-head k_scale and v_scale")
    return scale


def quantize_kv(x: jax.Array, scale: jax.Array, dtype: DTypeLike) -> jax.Array:
    """x: [T, Hkv, D] float -> dtype, dividing by the per-head scale [Hkv]."""
    y = x.astype(jnp.float32) / scale[None, :, None]
    if jnp.issubdtype(dtype, jnp.integer):
        ints = jnp.iinfo(dtype)
        y = jnp.clip(jnp.round(y), ints.min, ints.max)
    else:
        floats = jnp.finfo(dtype)
        y = jnp.clip(y, float(floats.min), float(floats.max))
    return y.astype(dtype)


def stored_k_v(
    k: jax.Array,
    v: jax.Array,
    cache_dtype: DTypeLike,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """This step's K and V ([T, Hkv, D] each) as the cache stores them: in `cache_dtype`,
    quantized with the per-head scales for an int8/fp8 cache."""
    if is_quantized(cache_dtype):
        return quantize_kv(k, kv_scale(k_scale), cache_dtype), quantize_kv(v, kv_scale(v_scale), cache_dtype)
    return k.astype(cache_dtype), v.astype(cache_dtype)


def stored_kv(
    k: jax.Array,
    v: jax.Array,
    cache_dtype: DTypeLike,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:
    """`stored_k_v` interleaved as the cache rows hold them: [T, 2 * Hkv, D], K of head h at 2h
    and V at 2h + 1."""
    num_tokens, num_kv_heads, d = k.shape
    k, v = stored_k_v(k, v, cache_dtype, k_scale, v_scale)
    return jnp.stack([k, v], axis=2).reshape(num_tokens, 2 * num_kv_heads, d)


def owns_rows(pos: jax.Array, rows: int, shard: jax.Array | int, shards: int) -> jax.Array:
    """Whether each position lies in `shard`'s rows of its page, where pages of rows * shards
    positions are split row-wise over `shards` (a cache split along the sequence: split_rows.py)."""
    return (pos % (rows * shards)) // rows == shard


def write_kv(
    kv_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    rows_of: tuple[jax.Array | int, int] = (0, 1),
) -> jax.Array:
    """Scatter this step's new K/V ([T, Hkv, D]) into their slots; padding tokens are dropped.
    `rows_of` (shard, shards): kv_cache [P, R, 2K, D] is that shard's rows of pages of R * shards
    positions, and only the tokens that fall in them are written."""
    num_pages, rows, two_hkv, d = kv_cache.shape
    shard, shards = rows_of
    seq, pos, valid = token_positions(kv_lens, cu_q_lens, num_seqs, k.shape[0])
    page = page_indices[seq, pos // (rows * shards)]
    mine = valid & owns_rows(pos, rows, shard, shards)
    slot = jnp.where(mine, page * rows + pos % rows, num_pages * rows)
    kv_new = stored_kv(k, v, kv_cache.dtype, k_scale, v_scale)
    if k.shape[0] == 1:
        # XLA turns a one-row scatter into read-old-slot / select / dynamic-update-slice, and
        # reading the donated cache before writing it makes XLA copy the whole layer's cache on
        # every decode step. A second, dropped row keeps it a scatter, which is done in place.
        slot = jnp.concatenate([slot, jnp.full((1,), num_pages * rows, slot.dtype)])
        kv_new = jnp.concatenate([kv_new, jnp.zeros_like(kv_new)])
    flat = kv_cache.reshape(num_pages * rows, two_hkv, d)
    flat = flat.at[slot].set(kv_new, mode="drop")
    return flat.reshape(kv_cache.shape)
