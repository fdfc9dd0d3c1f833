"""Ragged paged attention in pure jnp: the CPU path and the oracle every kernel is tested against.

One call serves one layer for a ragged batch: sequences' query tokens lie back to back in `q`
(sequence s owns rows cu_q_lens[s]:cu_q_lens[s+1]); their new keys/values are first written into
the paged cache, then every query token attends causally over its own sequence's pages.

KV cache layout, shared by all implementations:
    kv_cache: [num_pages, page_size, 2 * Hkv, D]
K of kv head h sits at index 2h of the third axis and V at 2h + 1, so sharding that axis by kv
heads keeps each head's K/V pair on one shard. Quantized caches (int8, float8) hold x / scale with
one float32 scale per kv head for K and one for V (`k_scale`, `v_scale`, shape [Hkv]).

Query token j of sequence s sits at position kv_lens[s] - q_len[s] + j. Tokens past
cu_q_lens[num_seqs] are padding: their K/V writes are dropped and their output rows are zero.

Each token attends to this step's tokens of its sequence densely (from k/v as the cache stores
them) and to its earlier context page block by page block with an online softmax, so memory stays
O(T * block + T^2), decode costs O(context) per token, and a prompt's first chunk reads no pages.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import is_quantized

# Gathered K/V elements per block step; bounds the reference's working set on the CPU.
_BLOCK_ELEMENTS = 1 << 18
# Tokens per block at most: the loop stops at the longest real sequence, so a small block keeps
# short sequences in a long-context page table from paying for the table's whole width.
_MAX_BLOCK_TOKENS = 512


def kv_cache_shape(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int):
    return (num_pages, page_size, 2 * num_kv_heads, head_dim)


def token_positions(kv_lens, cu_q_lens, num_seqs, num_tokens: int):
    """Per query token: (sequence index, absolute position, is-real-token), each [T]."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    num_seqs = jnp.asarray(num_seqs).reshape(-1)[0]
    seq = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, kv_lens.shape[0] - 1)
    valid = t < cu_q_lens[num_seqs]
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (t - cu_q_lens[seq])
    return seq, jnp.where(valid, pos, 0), valid


def quantize_kv(x, scale, dtype):
    """x: [T, Hkv, D] float -> dtype, dividing by the per-head scale [Hkv]."""
    y = x.astype(jnp.float32) / scale[None, :, None]
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        y = jnp.clip(jnp.round(y), info.min, info.max)
    else:
        info = jnp.finfo(dtype)
        y = jnp.clip(y, float(info.min), float(info.max))
    return y.astype(dtype)


def stored_kv(k, v, cache_dtype, k_scale=None, v_scale=None):
    """This step's K/V as the cache stores them: [T, 2 * Hkv, D] in `cache_dtype`, K of head h
    at 2h and V at 2h + 1 (quantized with the per-head scales for an int8/fp8 cache)."""
    num_tokens, num_kv_heads, d = k.shape
    if is_quantized(cache_dtype):
        k = quantize_kv(k, k_scale, cache_dtype)
        v = quantize_kv(v, v_scale, cache_dtype)
    return jnp.stack([k, v], axis=2).reshape(num_tokens, 2 * num_kv_heads, d).astype(cache_dtype)


def write_kv(kv_cache, k, v, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale=None, v_scale=None):
    """Scatter this step's new K/V ([T, Hkv, D]) into their slots; padding tokens are dropped."""
    num_pages, page_size, two_hkv, d = kv_cache.shape
    seq, pos, valid = token_positions(kv_lens, cu_q_lens, num_seqs, k.shape[0])
    page = page_indices[seq, pos // page_size]
    slot = jnp.where(valid, page * page_size + pos % page_size, num_pages * page_size)
    kv_new = stored_kv(k, v, kv_cache.dtype, k_scale, v_scale)
    flat = kv_cache.reshape(num_pages * page_size, two_hkv, d)
    flat = flat.at[slot].set(kv_new, mode="drop")
    return flat.reshape(kv_cache.shape)


def _pages_per_block(num_tokens, page_size, two_hkv, d, pages_per_seq):
    per_page = max(1, num_tokens * page_size * two_hkv * d)
    ppb = max(1, min(_BLOCK_ELEMENTS // per_page, _MAX_BLOCK_TOKENS // page_size))
    ppb = 1 << (ppb.bit_length() - 1)  # power of two
    return min(ppb, pages_per_seq)


def _stored(x, scale, dtype):
    """x [T, K, D] as the cache holds it (rounded to its dtype, or quantized), read back in f32."""
    if is_quantized(dtype):
        return quantize_kv(x, scale, dtype).astype(jnp.float32) * scale[None, :, None]
    return x.astype(dtype).astype(jnp.float32)


def _merge(carry, s, pv):
    """Online-softmax update of (m, l, acc) with masked scores s [T, K, G, N]; pv(p) -> [T, K, G, D]."""
    m, l, acc = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    alpha = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
    return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv(p)


def _cap(s, soft_cap):
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def ragged_paged_attention_reference(
    q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
    *, sm_scale, sliding_window=None, soft_cap=None, k_scale=None, v_scale=None,
):
    """Writes k/v into kv_cache, then attends. Returns (out [T, Hq, D] in q.dtype, kv_cache).

    Each token attends to (1) the tokens of its sequence in this step, densely from k/v as the
    cache stores them, and (2) its sequence's earlier context, page block by page block. Part (2)
    runs zero blocks for a first prefill chunk, so a prompt never re-reads its own pages per token.
    """
    kv_cache = write_kv(kv_cache, k, v, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale)
    num_tokens, num_q_heads, d = q.shape
    _, page_size, two_hkv, _ = kv_cache.shape
    num_kv_heads = two_hkv // 2
    group = num_q_heads // num_kv_heads
    pages_per_seq = page_indices.shape[1]

    seq, pos, valid = token_positions(kv_lens, cu_q_lens, num_seqs, num_tokens)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    ctx_len = jnp.where(valid, kv_lens[seq] - q_len, 0)  # [T] cached tokens before this step
    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, d) * sm_scale

    # (1) this step's tokens of the same sequence, causally.
    k_new = _stored(k, k_scale, kv_cache.dtype)  # [T, K, D]
    v_new = _stored(v, v_scale, kv_cache.dtype)
    s = _cap(jnp.einsum("tkgd,ukd->tkgu", qg, k_new), soft_cap)  # [T, K, G, T]
    mask = valid[:, None] & valid[None, :] & (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    if sliding_window is not None:
        mask &= pos[:, None] - pos[None, :] < sliding_window
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    init = (jnp.full((num_tokens, num_kv_heads, group), -jnp.inf, jnp.float32),
            jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
            jnp.zeros((num_tokens, num_kv_heads, group, d), jnp.float32))
    carry = _merge(init, s, lambda p: jnp.einsum("tkgu,ukd->tkgd", p, v_new))

    # (2) the earlier context from the pages, a block of pages at a time.
    ppb = _pages_per_block(num_tokens, page_size, two_hkv, d, pages_per_seq)
    block = ppb * page_size
    token_pages = jnp.pad(page_indices[seq], ((0, 0), (0, (-pages_per_seq) % ppb)))  # [T, >= pages_per_seq]
    if is_quantized(kv_cache.dtype):
        scales = jnp.stack([k_scale, v_scale], axis=1).reshape(two_hkv).astype(jnp.float32)
    else:
        scales = jnp.ones((two_hkv,), jnp.float32)

    def body(j, carry):
        pages = jax.lax.dynamic_slice_in_dim(token_pages, j * ppb, ppb, axis=1)  # [T, ppb]
        kv = kv_cache[pages].reshape(num_tokens, block, two_hkv, d)
        kv = kv.astype(jnp.float32) * scales[None, None, :, None]
        kb, vb = kv[:, :, 0::2], kv[:, :, 1::2]  # [T, B, K, D]
        kpos = j * block + jnp.arange(block, dtype=jnp.int32)  # [B]
        in_ctx = kpos[None, :] < ctx_len[:, None]  # [T, B]
        # Slots past the context hold whatever was there before, NaN included; p == 0 does not
        # help there (0 * NaN), so V itself is zeroed.
        vb = jnp.where(in_ctx[:, :, None, None], vb, 0.0)
        s = _cap(jnp.einsum("tkgd,tbkd->tkgb", qg, kb), soft_cap)
        mask = in_ctx
        if sliding_window is not None:
            mask &= pos[:, None] - kpos[None, :] < sliding_window
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        return _merge(carry, s, lambda p: jnp.einsum("tkgb,tbkd->tkgd", p, vb))

    num_blocks = (jnp.max(ctx_len) + block - 1) // block
    _, l, acc = jax.lax.fori_loop(0, num_blocks, body, carry)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_q_heads, d).astype(q.dtype), kv_cache
