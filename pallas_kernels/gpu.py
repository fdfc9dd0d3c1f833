"""Ragged paged attention for GPUs: a Pallas kernel on the Triton lowering.

One call, as the contract in ARCHITECTURE.md: write this step's K/V into the cache and attend.

1. Stored rows (XLA, T * 2Hkv * D elements): this step's K/V as the cache holds them
   (`reference.stored_kv`: cast, or quantized with the per-head scales), [T, 2Hkv, D].
2. Work list (XLA, O(S + T/bq) integers): the ragged batch is cut into work items, each a block
   of at most `block_q` query tokens of ONE sequence. Item w knows its row count, the position of
   its first row, its page-table offset, its sequence's cached context length and the offset
   from a position of this step to its token index (`meta[w]`). There are at most
   cdiv(T, bq) + S items, a static bound, so the grid is static; items past the real count do
   nothing. A block never spans two sequences, so rows are never masked by sequence.
3. Kernel grid (W, Hkv, C): work item x kv head x KV split. A program loads its q block
   [bq * Gp, D] (the bq tokens x the G query heads of kv head h, G padded to the power of two Gp
   and bq chosen so that rows >= 16 for Triton's dots) and runs a float32 online softmax over
   its keys in blocks of `block_kv` positions, aligned to block_kv from the sliding window's
   start. Cached positions [0, ctx_len) are gathered from the cache by slot, the slot of each
   position looked up in the flattened page table (an ordinary input: Triton has no scalar
   prefetch); this step's positions [ctx_len, kv_end) are gathered from the stored rows of step
   1, never from the cache. The one block that straddles ctx_len gathers from both and selects
   per key, so a decode token costs no extra block. Gather indices are clamped into each
   source's real range, so only owned pages and real rows are read. Reading this step's keys
   from the stored rows is what makes the fused write safe: Triton has no barrier across
   programs, and no program reads a slot that any program of this call writes. The cache is
   viewed as [P * page, 2Hkv, D] with a BlockSpec holding K and V of head h.
4. KV write, fused: the split-0 program of each (item, head) stores its rows' K and V into their
   slots of the cache, which is an input/output alias (in place under donation). Rows past the
   item's count repeat row 0's slot and value, so no store needs a mask. A head_dim that is not
   a power of two is padded inside the kernel; then XLA writes the K/V (in place) and the kernel
   only reads the cache.
5. Split-K (flash-decoding): with few programs and long contexts, C > 1 programs share one
   item's KV blocks, a contiguous run each; each writes unnormalised (acc, m, l) and an XLA
   combine merges them.
6. The item blocks are gathered back to [T, Hq, D]; padding tokens get zeros.
7. The decode split, chosen at run time (`GpuPaths`, the default for a prefill-like batch): the
   sequences with one query token get an item each in a call with the decode blocks, and the
   others their items in a call with the prefill blocks; nothing recompiles when the mix
   changes. The calls run in turn over the one cache, each writing its own sequences' slots.

Supports bf16/f16/f32 q, an unquantized cache of q's dtype or an int8/fp8 cache with per-kv-head
scales, head_dim a multiple of 8 up to 256 (padded to a power of two inside the kernel, the
padding masked), page_size a power of two, sliding window, soft cap.
The shape limits, block sizes and split count (`unsupported_reason`, `GpuConfig`, `GpuPaths`,
`default_config`, `default_paths`) live in gpu_config.py.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common
from pallas_kernels.gpu_config import (
    GpuConfig,
    GpuPaths,
    check_config,
    default_paths,
    padded_head_dim,
    unsupported_reason,
)
from pallas_kernels.gpu_work import META_WIDTH, combine, q_blocks, work_list
from pallas_kernels.reference import stored_kv, write_kv

def _attention_kernel(meta_ref, pages_ref, scale_ref, q_ref, new_ref, cache_ref, *out_refs,
                      page_size, block_kv, gp, num_splits, sm_scale, sliding_window, soft_cap,
                      precision, real_dim):
    *o_refs, cache_out = out_refs if real_dim == q_ref.shape[1] else (*out_refs, None)
    rows_m, head_dim = q_ref.shape  # M = bq * Gp
    block_q = rows_m // gp
    rows, pos0, table_base = meta_ref[0], meta_ref[1], meta_ref[2]
    ctx_len, token_base = meta_ref[3], meta_ref[4]
    live = rows > 0
    kv_end = pos0 + rows  # causal end of the block's last row; <= kv_len
    kv_start = 0 if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
    page_shift = page_size.bit_length() - 1
    k_scale, v_scale = scale_ref[0], scale_ref[1]

    def slots(pos):  # positions -> cache rows, through the page table
        page = pages_ref[table_base + lax.shift_right_logical(pos, page_shift)]
        return page * page_size + (pos & (page_size - 1))

    # Key blocks are aligned to block_kv over positions [kv_start, kv_end): blocks below `full`
    # hold cached keys only, block `full` may straddle ctx_len (both sources), the rest hold
    # this step's keys only. A split takes a contiguous run of blocks.
    blk_lo = lax.div(kv_start, block_kv)  # operands are non-negative: lax.div, not //
    blk_hi = jnp.where(live, lax.div(kv_end + block_kv - 1, block_kv), blk_lo)
    per_split = lax.div(blk_hi - blk_lo + num_splits - 1, num_splits)
    lo = blk_lo + pl.program_id(2) * per_split
    hi = jnp.minimum(lo + per_split, blk_hi)
    full = lax.div(ctx_len, block_kv)
    mixed_end = lax.div(ctx_len + block_kv - 1, block_kv)

    q = q_ref[...]  # [M, D]
    row_pos = pos0 + lax.shift_right_logical(  # row r is token r // Gp
        lax.broadcasted_iota(jnp.int32, (rows_m, block_kv), 0), gp.bit_length() - 1)  # [M, N]
    col = lax.broadcasted_iota(jnp.int32, (rows_m, block_kv), 1)  # [M, N]
    v_row = lax.broadcasted_iota(jnp.int32, (block_kv, head_dim), 0)  # [N, D]
    key = lax.iota(jnp.int32, block_kv)  # [N]

    def cached_keys(first):  # positions past the context repeat its last one
        slot = slots(jnp.minimum(first + key, ctx_len - 1))  # [N]
        k, v = cache_ref[slot, 0, :], cache_ref[slot, 1, :]
        if real_dim == head_dim:
            return k, v
        # The block overhangs the cache row: the lowering masks the load to the real columns,
        # whose rest is undefined; zero it (q's padding is zero, but 0 * NaN would not be).
        real = lax.broadcasted_iota(jnp.int32, (block_kv, head_dim), 1) < real_dim
        return jnp.where(real, k, 0), jnp.where(real, v, 0)

    def new_keys(first):  # positions outside [ctx_len, kv_end) repeat its nearest end
        token = jnp.clip(first + key, ctx_len, kv_end - 1) + token_base  # [N]
        return new_ref[token, 0, :], new_ref[token, 1, :]

    def mixed_keys(first):
        (kc, vc), (kn, vn) = cached_keys(first), new_keys(first)
        cached = (first + key < ctx_len)[:, None]  # [N, 1]
        return jnp.where(cached, kc, kn), jnp.where(cached, vc, vn)

    def block(keys):
        def body(b, carry):
            first = b * block_kv
            k, v = keys(first)  # [N, D] each, as stored
            s = common.block_scores(q, k.astype(q.dtype), scale=sm_scale * k_scale,
                                    soft_cap=soft_cap, precision=precision)  # [M, N]
            kpos = first + col
            mask = (kpos <= row_pos) & (kpos < kv_end)
            if sliding_window is not None:
                mask = mask & (row_pos - kpos < sliding_window)
            s = jnp.where(mask, s, common.MASK_VALUE)
            v = jnp.where(first + v_row < kv_end, v.astype(q.dtype), 0)
            return common.online_softmax_update(carry, s, v, precision=precision, keepdims=False)
        return body

    carry = (jnp.full((rows_m,), common.MASK_VALUE, jnp.float32),
             jnp.zeros((rows_m,), jnp.float32), jnp.zeros((rows_m, head_dim), jnp.float32))
    carry = lax.fori_loop(lo, jnp.minimum(hi, full), block(cached_keys), carry)
    carry = lax.fori_loop(jnp.maximum(lo, full), jnp.minimum(hi, mixed_end), block(mixed_keys), carry)
    m, l, acc = lax.fori_loop(jnp.maximum(lo, mixed_end), hi, block(new_keys), carry)

    if cache_out is not None:  # the fused KV write (see _call_kernel)
        @pl.when(live & (pl.program_id(2) == 0))
        def _write():
            i = lax.iota(jnp.int32, block_q)
            pos = pos0 + jnp.where(i < rows, i, 0)  # rows past the count repeat row 0
            slot = slots(pos)
            cache_out[slot, 0, :] = new_ref[pos + token_base, 0, :]
            cache_out[slot, 1, :] = new_ref[pos + token_base, 1, :]

    if num_splits == 1:
        (o_ref,) = o_refs
        inv = v_scale / jnp.where(l > 0, l, 1.0)
        o_ref[...] = (acc * inv[:, None]).astype(o_ref.dtype)
    else:
        o_ref, m_ref, l_ref = o_refs
        o_ref[...] = acc * v_scale
        m_ref[...] = m
        l_ref[...] = l


def _call_kernel(meta: jax.Array, flat_pages: jax.Array, scales: jax.Array, q_blocks: jax.Array,
                 kv_new: jax.Array, kv_cache: jax.Array, *, config: GpuConfig, gp: int,
                 interpret: bool, **opts: object) -> tuple[jax.Array, jax.Array]:
    """The pallas_call over grid (W, Hkv, C) -> (out blocks [W, Hkv, M, D], kv_cache written)."""
    num_items, num_kv_heads, rows_m, head_dim = q_blocks.shape  # head_dim padded to a power of 2
    num_pages, page_size, two_hkv, real_head_dim = kv_cache.shape
    splits = config.num_splits
    kernel = functools.partial(_attention_kernel, page_size=page_size, gp=gp, num_splits=splits,
                               block_kv=config.block_kv, real_dim=real_head_dim, **opts)
    # A cache row narrower than head_dim (not a power of two): the BlockSpec's last dim
    # overhangs the array and the lowering masks its loads to the real columns. The kernel then
    # only reads the cache; the caller writes this step's K/V with XLA (compiled on an H100, the
    # fused write of an overhanging block corrupted neighbouring slots).
    fused_write = real_head_dim == head_dim
    flat_cache = kv_cache.reshape(num_pages * page_size, two_hkv, real_head_dim)
    head_kv = lambda rows: pl.BlockSpec((rows, 2, head_dim), lambda w, h, c: (0, h, 0))  # noqa: E731
    in_specs = [
        pl.BlockSpec((None, META_WIDTH), lambda w, h, c: (w, 0)),  # meta
        pl.BlockSpec(flat_pages.shape, lambda w, h, c: (0,)),  # flattened page table
        pl.BlockSpec((None, 2), lambda w, h, c: (h, 0)),  # (k_scale, v_scale) of head h
        pl.BlockSpec((None, None, rows_m, head_dim), lambda w, h, c: (w, h, 0, 0)),  # q block
        head_kv(kv_new.shape[0]),  # this step's K, V of head h
        head_kv(flat_cache.shape[0]),  # the cache's K, V of head h
    ]
    if splits == 1:
        out_specs = [pl.BlockSpec((None, None, rows_m, head_dim), lambda w, h, c: (w, h, 0, 0))]
        out_shape = [jax.ShapeDtypeStruct(q_blocks.shape, q_blocks.dtype)]
    else:
        part = (splits, num_items, num_kv_heads, rows_m)
        out_specs = [
            pl.BlockSpec((None, None, None, rows_m, head_dim), lambda w, h, c: (c, w, h, 0, 0)),
            pl.BlockSpec((None, None, None, rows_m), lambda w, h, c: (c, w, h, 0)),
            pl.BlockSpec((None, None, None, rows_m), lambda w, h, c: (c, w, h, 0)),
        ]
        out_shape = [jax.ShapeDtypeStruct(part + (head_dim,), jnp.float32),
                     jax.ShapeDtypeStruct(part, jnp.float32), jax.ShapeDtypeStruct(part, jnp.float32)]
    if fused_write:
        out_specs.append(head_kv(flat_cache.shape[0]))
        out_shape.append(jax.ShapeDtypeStruct(flat_cache.shape, flat_cache.dtype))
    result = pl.pallas_call(
        kernel, grid=(num_items, num_kv_heads, splits), in_specs=in_specs,
        out_specs=out_specs, out_shape=out_shape,
        input_output_aliases={5: len(out_shape) - 1} if fused_write else {}, interpret=interpret,
        name="ragged_paged_attention_gpu",
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
    )(meta, flat_pages, scales, q_blocks, kv_new, flat_cache)
    if fused_write:
        *result, flat_cache = result
    out = result[0] if splits == 1 else combine(*result)
    return out, flat_cache.reshape(kv_cache.shape)


def _attend(q: jax.Array, kv_new: jax.Array, kv_cache: jax.Array, scales: jax.Array,
            kv_lens: jax.Array, page_indices: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array,
            *, config: GpuConfig, select: jax.Array | None, num_items: int | None,
            **opts: object) -> tuple[jax.Array, jax.Array]:
    """One kernel call over the selected sequences (all if `select` is None) -> (out [T, Hq, D],
    zeros for every other token; kv_cache with their K/V written)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[2] // 2
    group = num_q_heads // num_kv_heads
    bq, gp, dp = config.block_q, common.next_pow2(group), padded_head_dim(head_dim)
    meta, token_item, token_row, tvalid = work_list(
        cu_q_lens, kv_lens, num_seqs, num_tokens, bq, page_indices.shape[1], select=select,
        num_items=num_items)
    out_blocks, kv_cache = _call_kernel(
        meta, page_indices.reshape(-1).astype(jnp.int32), scales,
        q_blocks(q, meta, num_kv_heads, bq, gp, dp), kv_new, kv_cache, config=config, gp=gp, **opts)
    out_blocks = out_blocks.reshape(meta.shape[0], num_kv_heads, bq, gp, dp)
    out = out_blocks[token_item, :, token_row][:, :, :group, :head_dim]  # [T, Hkv, G, D]
    out = jnp.where(tvalid[:, None, None, None], out.astype(q.dtype), 0)
    return out.reshape(num_tokens, num_q_heads, head_dim), kv_cache


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "config", "interpret"))
def ragged_paged_attention_gpu(
    q: jax.Array, k: jax.Array, v: jax.Array, kv_cache: jax.Array, kv_lens: jax.Array,
    page_indices: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array,
    *, sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    k_scale: jax.Array | None = None, v_scale: jax.Array | None = None,
    config: GpuConfig | GpuPaths | None = None, interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """q [T, Hq, D]; k, v [T, Hkv, D]; kv_cache [P, page, 2*Hkv, D] -> (out [T, Hq, D], kv_cache).

    `config` overrides the block sizes / splits chosen by `default_paths`: one GpuConfig runs one
    call over the whole batch, GpuPaths a decode call and a call for the rest. `interpret=True`
    runs the kernel in the Pallas interpreter (CPU tests)."""
    common.validate_kernel_call("pallas_gpu", unsupported_reason, q, k, v, kv_cache, kv_lens,
                                page_indices, cu_q_lens, num_seqs, k_scale, v_scale,
                                sliding_window, soft_cap)
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, two_hkv, _ = kv_cache.shape
    num_kv_heads = two_hkv // 2
    group = num_q_heads // num_kv_heads
    num_seqs_max, pages_per_seq = page_indices.shape
    if config is None:
        config = default_paths(num_tokens, num_seqs_max, group, num_kv_heads, head_dim,
                               page_size, pages_per_seq, q.dtype)
    check_config(config, common.next_pow2(group))
    dp = padded_head_dim(head_dim)

    kv_new = stored_kv(k, v, kv_cache.dtype, k_scale, v_scale)  # [T, 2Hkv, D]
    if dp != head_dim:  # the kernel cannot write an overhanging block: XLA writes, in place
        kv_cache = write_kv(kv_cache, k, v, kv_lens, page_indices, cu_q_lens, num_seqs,
                            k_scale, v_scale)
    kv_new = jnp.pad(kv_new, ((0, 0), (0, 0), (0, dp - head_dim)))
    operands = (common.kv_scales(kv_cache, k_scale, v_scale), kv_lens, page_indices, cu_q_lens,
                num_seqs)
    opts = dict(interpret=interpret, sm_scale=float(sm_scale), sliding_window=sliding_window,
                soft_cap=soft_cap,
                precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None)
    if isinstance(config, GpuConfig):
        return _attend(q, kv_new, kv_cache, *operands, config=config, select=None,
                       num_items=None, **opts)
    # The run-time split: each call writes and reads only its own sequences' slots.
    decode = common.real_q_lens(cu_q_lens, num_seqs) == 1
    out_d, kv_cache = _attend(q, kv_new, kv_cache, *operands, config=config.decode, select=decode,
                              num_items=min(num_tokens, num_seqs_max), **opts)
    out_r, kv_cache = _attend(q, kv_new, kv_cache, *operands, config=config.rest, select=~decode,
                              num_items=None, **opts)
    return out_d + out_r, kv_cache  # each is zero on the other's tokens
