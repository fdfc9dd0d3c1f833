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

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from pallas_kernels.common import SoftmaxCarry, is_quantized, token_positions
from pallas_kernels.kv_write import kv_scale, owns_rows, quantize_kv, write_kv

# Gathered K/V elements per block step; bounds the reference's working set on the CPU.
_BLOCK_ELEMENTS = 1 << 18
# Tokens per block at most: a small block spares short sequences a long table's whole width (the loop
# stops at the longest); at batch 1, 128 vs 512: SmolLM2's decode ~11% faster at ~100 tokens (RESULTS.md).
_MAX_BLOCK_TOKENS = 128


def _pages_per_block(num_tokens: int, page_size: int, two_hkv: int, d: int, pages_per_seq: int) -> int:
    per_page = max(1, num_tokens * page_size * two_hkv * d)
    ppb = max(1, min(_BLOCK_ELEMENTS // per_page, _MAX_BLOCK_TOKENS // page_size))
    ppb = 1 << (ppb.bit_length() - 1)  # power of two
    return min(ppb, pages_per_seq)


def _stored(x: jax.Array, scale: jax.Array | None, dtype: DTypeLike) -> jax.Array:
    """x [T, K, D] as the cache holds it (rounded to its dtype, or quantized), read back in f32."""
    if is_quantized(dtype):
        scale = kv_scale(scale)
        return quantize_kv(x, scale, dtype).astype(jnp.float32) * scale[None, :, None]
    return x.astype(dtype).astype(jnp.float32)


def _merge(carry: SoftmaxCarry, s: jax.Array, pv: Callable[[jax.Array], jax.Array]) -> SoftmaxCarry:
    """Online-softmax update of (m, l, acc) with masked scores s [T, K, G, N]; pv(p) -> [T, K, G, D]."""
    m, l, acc = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    alpha = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
    return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv(p)


def _cap(s: jax.Array, soft_cap: float | None) -> jax.Array:
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def _attend_step_tokens(
    qg: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    seq: jax.Array,
    pos: jax.Array,
    valid: jax.Array,
    *,
    sliding_window: int | None,
    soft_cap: float | None,
    keys: jax.Array | None = None,
) -> SoftmaxCarry:
    """Part (1): qg [T, K, G, D] over this step's tokens of the same sequence, causally, with
    k_new / v_new [T, K, D] as the cache stores them (`keys` [T]: only these tokens' K/V, a
    shard's own under a split cache: split_rows.py). Returns the online-softmax carry.

    The scores are laid out KV-head-major ([K, G, T, T]): the same math as token-major, but
    XLA:CPU runs these matmuls ~3.7x faster (a 2048-token chunk: 48 vs 176 ms per score matmul).
    The [T, T] mask is computed once: fused into its [K, G, T, T] consumers, XLA:CPU recomputed
    each token's sequence and position for every score, twice (SmolLM2's 30 layers on a
    256-token prompt: 68 -> 60 ms)."""
    keys = valid if keys is None else keys  # the tokens whose K/V are read
    mask = valid[:, None] & keys[None, :] & (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    if sliding_window is not None:
        mask &= pos[:, None] - pos[None, :] < sliding_window
    mask = jax.lax.optimization_barrier(mask)
    q_heads = qg.transpose(1, 2, 0, 3)  # [K, G, T, D]
    s = _cap(jnp.einsum("kgtd,kud->kgtu", q_heads, k_new.transpose(1, 0, 2)), soft_cap)  # [K, G, T, T]
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1)  # [K, G, T]
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)[..., None])
    acc = jnp.einsum("kgtu,kud->kgtd", p, v_new.transpose(1, 0, 2))  # [K, G, T, D]
    return m.transpose(2, 0, 1), jnp.sum(p, axis=-1).transpose(2, 0, 1), acc.transpose(2, 0, 1, 3)


def _attend_context(
    carry: SoftmaxCarry,
    qg: jax.Array,
    kv_cache: jax.Array,
    k_scale: jax.Array | None,
    v_scale: jax.Array | None,
    token_pages: jax.Array,
    pos: jax.Array,
    ctx_len: jax.Array,
    *,
    sliding_window: int | None,
    soft_cap: float | None,
    rows_of: tuple[jax.Array | int, int] = (0, 1),
) -> SoftmaxCarry:
    """Part (2): qg [T, K, G, D] over each token's cached context [0, ctx_len), reading its
    sequence's pages (token_pages [T, pages_per_seq]) a block of pages at a time. `rows_of`
    (shard, shards): the cache holds that shard's rows of every page only (split_rows.py).

    Each block gathers one head's K (or V) rows straight into [T, K, B, D] from the cache viewed
    as rows of D (slot * 2K + 2k for K, + 1 for V), so the score and value products take their
    operands batch-major as gathered; gathering whole pages and splitting K from V after made
    XLA:CPU transpose both into that order on every block (SmolLM2's 30 layers at 8 decode tokens
    x 96 context: 13.3 -> 11.0 ms; one token: 3.5 -> 2.3 ms; benchmarks/RESULTS.md)."""
    num_tokens, num_kv_heads, _, d = qg.shape
    _, page_size, two_hkv, _ = kv_cache.shape
    pages_per_seq = token_pages.shape[1]
    ppb = _pages_per_block(num_tokens, page_size, two_hkv, d, pages_per_seq)
    block, (shard, shards) = ppb * page_size, rows_of  # a page's positions: page_size * shards
    token_pages = jnp.pad(token_pages, ((0, 0), (0, (-pages_per_seq) % ppb)))  # [T, >= pages_per_seq]
    rows = kv_cache.reshape(-1, d)  # [num_pages * page_size * 2K, D]
    heads = 2 * jnp.arange(num_kv_heads, dtype=jnp.int32)  # K of head k at 2k, V at 2k + 1
    in_page = jnp.arange(page_size, dtype=jnp.int32)
    quantized = is_quantized(kv_cache.dtype)

    def read(idx: jax.Array, scale: jax.Array | None) -> jax.Array:  # [T, K, B] -> [T, K, B, D] f32
        x = rows[idx].astype(jnp.float32)
        return x * kv_scale(scale).astype(jnp.float32)[None, :, None, None] if quantized else x

    def body(j: jax.Array, carry: SoftmaxCarry) -> SoftmaxCarry:
        pages = jax.lax.dynamic_slice_in_dim(token_pages, j * ppb, ppb, axis=1)  # [T, ppb]
        slots = (pages[:, :, None] * page_size + in_page).reshape(num_tokens, block)  # [T, B]
        idx = slots[:, None, :] * two_hkv + heads[None, :, None]  # [T, K, B]
        kb, vb = read(idx, k_scale), read(idx + 1, v_scale)
        kpos = ((j * ppb + jnp.arange(ppb)[:, None]) * shards + shard) * page_size + in_page  # [ppb, page]
        kpos = kpos.reshape(block)  # [B]
        in_ctx = kpos[None, :] < ctx_len[:, None]  # [T, B]
        # Slots past the context hold whatever was there before, NaN included; p == 0 does not
        # help there (0 * NaN), so V itself is zeroed.
        vb = jnp.where(in_ctx[:, None, :, None], vb, 0.0)
        s = _cap(jnp.einsum("tkgd,tkbd->tkgb", qg, kb), soft_cap)
        mask = in_ctx
        if sliding_window is not None:
            mask &= pos[:, None] - kpos[None, :] < sliding_window
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        return _merge(carry, s, lambda p: jnp.einsum("tkgb,tkbd->tkgd", p, vb))

    num_blocks = (jnp.max(ctx_len) + block * shards - 1) // (block * shards)
    return jax.lax.fori_loop(0, num_blocks, body, carry)


def ragged_paged_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_cache: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Writes k/v into kv_cache, then attends. Returns (out [T, Hq, D] in q.dtype, kv_cache).

    Each token attends to (1) the tokens of its sequence in this step, densely from k/v as the
    cache stores them, and (2) its sequence's earlier context, page block by page block. Part (2)
    runs zero blocks for a first prefill chunk, so a prompt never re-reads its own pages per token.
    """
    kv_cache = write_kv(kv_cache, k, v, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale)
    (_, l, acc), valid = attend_carry(
        *(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale),
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(q.shape).astype(q.dtype), kv_cache


def attend_carry(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_cache: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    sm_scale: float,
    *,
    sliding_window: int | None,
    soft_cap: float | None,
    k_scale: jax.Array | None,
    v_scale: jax.Array | None,
    rows_of: tuple[jax.Array | int, int] = (0, 1),
) -> tuple[SoftmaxCarry, jax.Array]:
    """Parts (1) and (2) over a cache already written: the unnormalised online-softmax carry of
    every query token, and which tokens are real [T]. `rows_of` (shard, shards): the cache is that
    shard's rows of every page (split_rows.py), so only the keys in them count."""
    num_tokens, num_q_heads, d = q.shape
    num_kv_heads, (shard, shards) = kv_cache.shape[2] // 2, rows_of
    seq, pos, valid = token_positions(kv_lens, cu_q_lens, num_seqs, num_tokens)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    ctx_len = jnp.where(valid, kv_lens[seq] - q_len, 0)  # [T] cached tokens before this step
    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, num_q_heads // num_kv_heads, d) * sm_scale
    k_new = _stored(k, k_scale, kv_cache.dtype)  # [T, K, D]
    v_new = _stored(v, v_scale, kv_cache.dtype)
    rows = kv_cache.shape[1]
    keys = valid & owns_rows(pos, rows, shard, shards)  # this step's K/V the cache holds
    carry = _attend_step_tokens(
        qg, k_new, v_new, seq, pos, valid, sliding_window=sliding_window, soft_cap=soft_cap, keys=keys
    )
    return _attend_context(
        *(carry, qg, kv_cache, k_scale, v_scale, page_indices[seq], pos, ctx_len),
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        rows_of=rows_of,
    ), valid
