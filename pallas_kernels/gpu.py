"""Ragged paged attention for GPUs: a Pallas kernel on the Triton lowering.

One call, as the contract in ARCHITECTURE.md: write this step's K/V, then attend.

1. KV write: an XLA scatter (`reference.write_kv`) before the kernel, not a kernel of its own.
   Triton has no barrier across programs, so a program cannot know that the new keys it reads were
   already stored by the program that owns them; fusing would mean reading the new K/V from two
   places (cache and `k`/`v`) in every block. The scatter touches T * 2Hkv * D elements, works in
   place on the donated cache, and is ~1% of the bytes the attention reads even for a full prefill
   chunk, so a fused write would buy one launch, not bandwidth.
2. Work list (XLA, O(S + T/bq) integers): the ragged batch is cut into work items, each a block
   of at most `block_q` query tokens of ONE sequence. Item w knows its row count, the position of
   its first row and its page-table offset (`meta[w]`). There are at most cdiv(T, bq) + S items,
   a static bound, so the grid is static; items past the real count do nothing. A block never
   spans two sequences, so no program loops over sequences and no rows are masked by sequence.
3. Kernel grid (W, Hkv, C): work item x kv head x KV split. A program loads its q block
   [bq * Gp, D] (the bq tokens x the G query heads of kv head h, G padded to the power of two Gp
   and bq chosen so that rows >= 16 for Triton's dots), then walks the sequence's pages
   `pages_per_block` at a time: page ids come from the flattened page table (an ordinary input:
   Triton has no scalar prefetch), K and V are gathered as k_ref[pages] from the cache viewed
   through a BlockSpec that squeezes the head axis (K of head h at 2h, V at 2h+1), and an online
   softmax accumulates in float32. Pages past the causal end are replaced by the last needed page
   (never a page the sequence does not own) and V past kv_len is zeroed, so stale or NaN slots
   never reach the output.
4. Split-K (flash-decoding): with few programs and long contexts, C > 1 programs share one
   item's KV blocks; each writes unnormalised (acc, m, l) and an XLA combine merges them.
5. The item blocks are gathered back to [T, Hq, D]; padding tokens get zeros.

Supports bf16/f16/f32 q, an unquantized cache of q's dtype or an int8/fp8 cache with per-kv-head
scales, head_dim a power of two in [16, 256], page_size a power of two, sliding window, soft cap.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common
from pallas_kernels.reference import token_positions, write_kv

_NUM_SMS = 132  # H100 SXM; only steers the split-K heuristic.
_FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


@dataclasses.dataclass(frozen=True)
class GpuConfig:
    block_q: int          # query tokens per work item (power of two)
    pages_per_block: int  # pages per KV step (power of two); block_kv = pages_per_block * page
    num_splits: int       # KV splits per work item (1 = no combine step)
    num_warps: int = 4
    num_stages: int = 2


def unsupported_reason(q, kv_cache, page_indices) -> str | None:
    """None if the kernel takes these shapes, else why not (names the value)."""
    head_dim = q.shape[-1]
    page_size = kv_cache.shape[1]
    if (reason := common.dtype_mismatch(q, kv_cache, _FLOAT_DTYPES)) is not None:
        return reason
    if head_dim not in (16, 32, 64, 128, 256):
        return f"head_dim={head_dim} (want a power of two in [16, 256])"
    if page_size & (page_size - 1):
        return f"page_size={page_size} (want a power of two)"
    return None


def default_config(num_tokens, num_seqs, group, num_kv_heads, head_dim, page_size, pages_per_seq):
    gp = common.next_pow2(group)
    decode_like = num_tokens <= 2 * num_seqs
    rows = 16 if decode_like else (128 if head_dim <= 128 else 64)
    block_q = max(1, rows // gp)
    kv_tokens = 128 if decode_like and head_dim <= 128 else 64
    pages_per_block = max(1, kv_tokens // page_size, -(-16 // page_size))
    pages_per_block = min(pages_per_block, max(common.next_pow2(pages_per_seq), -(-16 // page_size)))
    num_splits = 1
    if decode_like:
        programs = num_seqs * num_kv_heads
        kv_blocks = -(-pages_per_seq // pages_per_block)
        num_splits = max(1, min(16, kv_blocks, common.next_pow2(-(-2 * _NUM_SMS // programs))))
    num_warps = 8 if block_q * gp >= 128 else 4
    return GpuConfig(block_q, pages_per_block, num_splits, num_warps, 2)


def _work_list(cu_q_lens, kv_lens, num_seqs, num_tokens, block_q, pages_per_seq):
    """Per work item: meta [W, 4] = (rows, first row's position, page-table offset, 0),
    token index of each row [W, bq] (num_tokens for empty rows), and per token t: (item, row)."""
    num_seqs_max = kv_lens.shape[0]
    q_lens = common.real_q_lens(cu_q_lens, num_seqs)  # [S]
    blocks = (q_lens + block_q - 1) // block_q
    cu_blocks = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(blocks, dtype=jnp.int32)])
    num_items = pl.cdiv(num_tokens, block_q) + num_seqs_max
    w = jnp.arange(num_items, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_blocks[1:], w, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, num_seqs_max - 1)
    live = w < cu_blocks[num_seqs_max]
    first = (w - cu_blocks[seq]) * block_q  # offset of row 0 inside its sequence
    rows = jnp.where(live, jnp.clip(q_lens[seq] - first, 0, block_q), 0)
    pos0 = jnp.where(live, kv_lens[seq] - q_lens[seq] + first, 0)
    meta = jnp.stack([rows, pos0, seq * pages_per_seq, jnp.zeros_like(rows)], axis=1)

    i = jnp.arange(block_q, dtype=jnp.int32)
    row_token = cu_q_lens[seq][:, None] + first[:, None] + i[None, :]
    row_token = jnp.where(i[None, :] < rows[:, None], row_token, num_tokens)  # [W, bq]

    t = jnp.arange(num_tokens, dtype=jnp.int32)
    tseq, _, tvalid = token_positions(kv_lens, cu_q_lens, num_seqs, num_tokens)
    offset = t - cu_q_lens[tseq]
    token_item = jnp.where(tvalid, cu_blocks[tseq] + offset // block_q, 0)
    token_row = jnp.where(tvalid, offset % block_q, 0)
    return meta, row_token, token_item, token_row, tvalid


def _attention_kernel(meta_ref, pages_ref, scale_ref, q_ref, k_ref, v_ref, *out_refs,
                      page_size, pages_per_block, gp, num_splits, sm_scale, sliding_window,
                      soft_cap, precision):
    rows_m, head_dim = q_ref.shape  # M = bq * Gp
    block_kv = pages_per_block * page_size
    rows, pos0, table_base = meta_ref[0], meta_ref[1], meta_ref[2]
    kv_end = pos0 + rows  # causal end of the block's last row; <= kv_len
    kv_start = 0 if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
    blk_lo = lax.div(kv_start, block_kv)  # operands are non-negative: lax.div, not //
    blk_hi = jnp.where(rows > 0, lax.div(kv_end + block_kv - 1, block_kv), blk_lo)
    per_split = lax.div(blk_hi - blk_lo + num_splits - 1, num_splits)
    b_start = blk_lo + pl.program_id(2) * per_split
    b_end = jnp.minimum(b_start + per_split, blk_hi)
    last_page = pages_ref[table_base + lax.div(jnp.maximum(kv_end - 1, 0), page_size)]
    k_scale, v_scale = scale_ref[0], scale_ref[1]

    q = q_ref[...]  # [M, D]
    row_pos = pos0 + lax.shift_right_logical(  # row r is token r // Gp
        lax.broadcasted_iota(jnp.int32, (rows_m, block_kv), 0), gp.bit_length() - 1)  # [M, N]
    col = lax.broadcasted_iota(jnp.int32, (rows_m, block_kv), 1)  # [M, N]
    v_row = lax.broadcasted_iota(jnp.int32, (block_kv, head_dim), 0)  # [N, D]
    slot = lax.iota(jnp.int32, pages_per_block)

    def body(b, carry):  # carry: m [M], l [M], acc [M, D]
        pages = pages_ref[pl.ds(table_base + b * pages_per_block, pages_per_block)]
        pages = jnp.where((b * pages_per_block + slot) * page_size < kv_end, pages, last_page)
        k = k_ref[pages].reshape(block_kv, head_dim).astype(q.dtype)  # [N, D]
        v = v_ref[pages].reshape(block_kv, head_dim).astype(q.dtype)  # [N, D]
        s = common.block_scores(q, k, scale=sm_scale * k_scale, soft_cap=soft_cap,
                                precision=precision)  # [M, N]
        kpos = b * block_kv + col
        mask = (kpos <= row_pos) & (kpos < kv_end)
        if sliding_window is not None:
            mask = mask & (row_pos - kpos < sliding_window)
        s = jnp.where(mask, s, common.MASK_VALUE)
        v = jnp.where(b * block_kv + v_row < kv_end, v, jnp.zeros_like(v))  # stale/NaN slots
        return common.online_softmax_update(carry, s, v, precision=precision, keepdims=False)

    init = (jnp.full((rows_m,), common.MASK_VALUE, jnp.float32),
            jnp.zeros((rows_m,), jnp.float32), jnp.zeros((rows_m, head_dim), jnp.float32))
    m, l, acc = lax.fori_loop(b_start, b_end, body, init)
    if num_splits == 1:
        (o_ref,) = out_refs
        inv = v_scale / jnp.where(l > 0, l, 1.0)
        o_ref[...] = (acc * inv[:, None]).astype(o_ref.dtype)
    else:
        o_ref, m_ref, l_ref = out_refs
        o_ref[...] = acc * v_scale
        m_ref[...] = m
        l_ref[...] = l


def _combine(o, m, l):
    """Merge C partial softmaxes: o [C, ..., D] unnormalised, m/l [C, ...] -> [..., D]."""
    m_max = jnp.max(m, axis=0)
    a = jnp.exp(m - m_max[None])
    l_tot = jnp.sum(a * l, axis=0)
    o = jnp.sum(a[..., None] * o, axis=0)
    return o / jnp.where(l_tot > 0, l_tot, 1.0)[..., None]


def _q_blocks(q, row_token, num_kv_heads, block_q, gp):
    """q [T, Hq, D] -> [W, Hkv, bq * Gp, D]; row r of a block is token r // Gp, head r % Gp."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_items = row_token.shape[0]
    group = num_q_heads // num_kv_heads
    rows = jnp.concatenate([q, jnp.zeros((1, num_q_heads, head_dim), q.dtype)])[row_token]
    rows = rows.reshape(num_items, block_q, num_kv_heads, group, head_dim)
    rows = jnp.pad(rows, ((0, 0), (0, 0), (0, 0), (0, gp - group), (0, 0)))
    return rows.transpose(0, 2, 1, 3, 4).reshape(num_items, num_kv_heads, block_q * gp, head_dim)


def _call_kernel(meta, flat_pages, scales, q_blocks, kv_cache, *, config, gp, interpret, **opts):
    """The pallas_call over grid (W, Hkv, C) -> out blocks [W, Hkv, M, D] (combined if C > 1)."""
    num_items, num_kv_heads, rows_m, head_dim = q_blocks.shape
    num_pages, page_size, _, _ = kv_cache.shape
    splits = config.num_splits
    kernel = functools.partial(_attention_kernel, page_size=page_size, gp=gp, num_splits=splits,
                               pages_per_block=config.pages_per_block, **opts)
    cache_view = (num_pages, page_size, None, head_dim)
    in_specs = [
        pl.BlockSpec((None, 4), lambda w, h, c: (w, 0)),  # meta
        pl.BlockSpec(flat_pages.shape, lambda w, h, c: (0,)),  # flattened page table
        pl.BlockSpec((None, 2), lambda w, h, c: (h, 0)),  # (k_scale, v_scale) of head h
        pl.BlockSpec((None, None, rows_m, head_dim), lambda w, h, c: (w, h, 0, 0)),  # q block
        pl.BlockSpec(cache_view, lambda w, h, c: (0, 0, 2 * h, 0)),  # K of head h
        pl.BlockSpec(cache_view, lambda w, h, c: (0, 0, 2 * h + 1, 0)),  # V of head h
    ]
    if splits == 1:
        out_specs = pl.BlockSpec((None, None, rows_m, head_dim), lambda w, h, c: (w, h, 0, 0))
        out_shape = jax.ShapeDtypeStruct(q_blocks.shape, q_blocks.dtype)
    else:
        part = (splits, num_items, num_kv_heads, rows_m)
        out_specs = [
            pl.BlockSpec((None, None, None, rows_m, head_dim), lambda w, h, c: (c, w, h, 0, 0)),
            pl.BlockSpec((None, None, None, rows_m), lambda w, h, c: (c, w, h, 0)),
            pl.BlockSpec((None, None, None, rows_m), lambda w, h, c: (c, w, h, 0)),
        ]
        out_shape = [jax.ShapeDtypeStruct(part + (head_dim,), jnp.float32),
                     jax.ShapeDtypeStruct(part, jnp.float32), jax.ShapeDtypeStruct(part, jnp.float32)]
    result = pl.pallas_call(
        kernel, grid=(num_items, num_kv_heads, splits), in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=interpret, name="ragged_paged_attention_gpu",
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
    )(meta, flat_pages, scales, q_blocks, kv_cache, kv_cache)
    return result if splits == 1 else _combine(*result)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "config", "interpret"))
def ragged_paged_attention_gpu(
    q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
    *, sm_scale, sliding_window=None, soft_cap=None, k_scale=None, v_scale=None,
    config: GpuConfig | None = None, interpret: bool = False,
):
    """q [T, Hq, D]; k, v [T, Hkv, D]; kv_cache [P, page, 2*Hkv, D] -> (out [T, Hq, D], kv_cache).

    `config` overrides the block sizes / splits chosen by `default_config`; `interpret=True`
    runs the kernel in the Pallas interpreter (CPU tests)."""
    common.check_contract(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
                          k_scale, v_scale)
    common.check_options(sliding_window, soft_cap)
    reason = unsupported_reason(q, kv_cache, page_indices)
    if reason is not None:
        raise common.UnsupportedShape(f"pallas_gpu cannot take {reason}")
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, two_hkv, _ = kv_cache.shape
    num_kv_heads = two_hkv // 2
    group = num_q_heads // num_kv_heads
    num_seqs_max, pages_per_seq = page_indices.shape
    if config is None:
        config = default_config(num_tokens, num_seqs_max, group, num_kv_heads, head_dim,
                                page_size, pages_per_seq)
    bq, ppb, gp = config.block_q, config.pages_per_block, common.next_pow2(group)
    if bq * gp < 16 or ppb * page_size < 16 or bq & (bq - 1) or ppb & (ppb - 1):
        raise common.UnsupportedShape(f"pallas_gpu config {config}: block_q * Gp and "
                                      "pages_per_block * page_size must be powers of two >= 16")

    kv_cache = write_kv(kv_cache, k, v, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale)
    meta, row_token, token_item, token_row, tvalid = _work_list(
        cu_q_lens, kv_lens, num_seqs, num_tokens, bq, pages_per_seq)
    flat_pages = jnp.concatenate([page_indices.reshape(-1).astype(jnp.int32),
                                  jnp.zeros((ppb,), jnp.int32)])  # tail: ds() past the last row
    out_blocks = _call_kernel(
        meta, flat_pages, common.kv_scales(kv_cache, k_scale, v_scale),
        _q_blocks(q, row_token, num_kv_heads, bq, gp), kv_cache, config=config, gp=gp,
        interpret=interpret, sm_scale=float(sm_scale), sliding_window=sliding_window,
        soft_cap=soft_cap, precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None)

    out_blocks = out_blocks.reshape(meta.shape[0], num_kv_heads, bq, gp, head_dim)
    out = out_blocks[token_item, :, token_row][:, :, :group]  # [T, Hkv, G, D]
    out = jnp.where(tvalid[:, None, None, None], out.astype(q.dtype), 0)
    return out.reshape(num_tokens, num_q_heads, head_dim), kv_cache
