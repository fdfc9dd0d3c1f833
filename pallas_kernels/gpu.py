"""Ragged paged attention for GPUs: a Pallas kernel on the Triton lowering.

One call, as the contract in ARCHITECTURE.md: write this step's K/V into the cache and attend.

1. Inputs as the step has them: q viewed as [T * Hq, D] rows, and this step's K and V as the
   cache stores them ([T, Hkv, D] each: k and v themselves for a cache of their dtype, else cast
   or quantized with the per-head scales by one XLA fusion). No gather or transpose around it.
2. Work list (XLA, O(S + T/bq) integers): the ragged batch is cut into work items, each a block
   of at most `block_q` query tokens of ONE sequence (`meta[w]`: row count, first position,
   page-table offset, cached context length, token offset). There are at most cdiv(T, bq) + S
   items, a static bound, so the grid is static; the items left idle zero the padding tokens.
3. Kernel grid (W, Hkv, C): work item x kv head x KV split. A program gathers its q rows
   [bq * Gp, D] (the bq tokens x the G query heads of kv head h, G padded to the power of two Gp,
   rows >= 16 for Triton's dots) and runs a float32 online softmax over its keys in blocks of
   `block_kv` positions, aligned from the sliding window's start. Cached positions [0, ctx_len)
   are gathered from the cache by slot through the flattened page table (an ordinary input:
   Triton has no scalar prefetch); this step's [ctx_len, kv_end) from the K/V inputs, never
   from the cache (so the fused write is safe: Triton has no barrier across programs). The
   block that straddles ctx_len reads both, so a decode token costs no extra block.
4. KV write, fused: the split-0 program of each (item, head) stores its rows' K and V into their
   slots of the cache, an input/output alias (in place under donation). A head_dim that is not
   a power of two is padded inside the kernel; then XLA writes the K/V and the kernel only reads.
5. Output: each program stores its rows straight into out [T * Hq, D]. Rows past the item's
   tokens or the group repeat a real row's values, so no load or store needs a mask.
   Split-K (flash-decoding, C > 1 programs share one item's KV blocks) stores unnormalised
   (acc, m, l) in the same rows, and one XLA fusion merges them.
6. The decode split, chosen at run time (`GpuPaths`, the default for a prefill-like batch): the
   sequences with one query token get an item each in a call with the decode blocks, and the
   others theirs in a call with the prefill blocks, over the first call's output buffer;
   nothing recompiles when the mix changes.

Supports bf16/f16/f32 q, an unquantized cache of q's dtype or an int8/fp8 cache with per-kv-head
scales, head_dim a multiple of 8 up to 256 (padded to a power of two inside the kernel, the
padding masked), page_size a power of two, sliding window, soft cap. The shape limits, block
sizes and split count live in gpu_config.py.
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
from pallas_kernels.gpu_work import META_WIDTH, combine, new_kv, work_list
from pallas_kernels.reference import write_kv


def _attention_kernel(
    meta_ref,
    pages_ref,
    scale_ref,
    q_ref,
    k_ref,
    v_ref,
    cache_ref,
    *refs,
    page_size,
    block_q,
    block_kv,
    group,
    gp,
    num_q_heads,
    num_splits,
    sm_scale,
    sliding_window,
    soft_cap,
    precision,
    real_dim,
    fused_write,
    has_prev,
):
    refs = refs[1:] if has_prev else refs  # the aliased output of the call before: not read
    *o_refs, cache_out = refs if fused_write else (*refs, None)
    rows_m, head_dim = block_q * gp, q_ref.shape[1]  # head_dim padded to a power of two
    rows, pos0, table_base, ctx_len, token_base = (meta_ref[i] for i in range(5))
    live = rows > 0
    kv_end = pos0 + rows  # causal end of the block's last row; <= kv_len
    kv_start = 0 if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
    k_scale, v_scale = scale_ref[0], scale_ref[1]

    def slots(pos):  # positions -> cache rows, through the page table
        page = pages_ref[table_base + lax.shift_right_logical(pos, page_size.bit_length() - 1)]
        return page * page_size + (pos & (page_size - 1))

    # Row r is token r // Gp of the item and query head r % Gp of kv head h. Rows past the
    # item's tokens repeat token 0 and heads past the group repeat head G - 1, so they compute
    # (and store) exactly that row's values.
    r = lax.iota(jnp.int32, rows_m)
    r_token = lax.shift_right_logical(r, gp.bit_length() - 1)  # [M]
    head = pl.program_id(1) * group + jnp.minimum(r & (gp - 1), group - 1)  # [M]
    token = jnp.where(r_token < rows, r_token, 0)
    out_row = (pos0 + token + token_base) * num_q_heads + head  # [M] rows of q and out

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

    q = q_ref[out_row, :]  # [M, D]
    row_pos = jnp.broadcast_to((pos0 + token)[:, None], (rows_m, block_kv))  # [M, N]
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
        return k_ref[token, :], v_ref[token, :]

    def mixed_keys(first):
        (kc, vc), (kn, vn) = cached_keys(first), new_keys(first)
        cached = (first + key < ctx_len)[:, None]  # [N, 1]
        return jnp.where(cached, kc, kn), jnp.where(cached, vc, vn)

    def block(keys):
        def body(b, carry):
            first = b * block_kv
            k, v = keys(first)  # [N, D] each, as stored
            s = common.block_scores(
                q, k.astype(q.dtype), scale=sm_scale * k_scale, soft_cap=soft_cap, precision=precision
            )  # [M, N]
            kpos = first + col
            mask = (kpos <= row_pos) & (kpos < kv_end)
            if sliding_window is not None:
                mask = mask & (row_pos - kpos < sliding_window)
            s = jnp.where(mask, s, common.MASK_VALUE)
            v = jnp.where(first + v_row < kv_end, v.astype(q.dtype), 0)
            return common.online_softmax_update(carry, s, v, precision=precision, keepdims=False)

        return body

    carry = (
        jnp.full((rows_m,), common.MASK_VALUE, jnp.float32),
        jnp.zeros((rows_m,), jnp.float32),
        jnp.zeros((rows_m, head_dim), jnp.float32),
    )
    carry = lax.fori_loop(lo, jnp.minimum(hi, full), block(cached_keys), carry)
    carry = lax.fori_loop(jnp.maximum(lo, full), jnp.minimum(hi, mixed_end), block(mixed_keys), carry)
    m, l, acc = lax.fori_loop(jnp.maximum(lo, mixed_end), hi, block(new_keys), carry)

    if cache_out is not None:  # the fused KV write (see _call_kernel)

        @pl.when(live & (pl.program_id(2) == 0))
        def _write():
            i = lax.iota(jnp.int32, block_q)
            pos = pos0 + jnp.where(i < rows, i, 0)  # rows past the count repeat row 0
            slot = slots(pos)
            cache_out[slot, 0, :] = k_ref[pos + token_base, :]
            cache_out[slot, 1, :] = v_ref[pos + token_base, :]

    if num_splits == 1:
        (o_ref,) = o_refs
        inv = v_scale / jnp.where(l > 0, l, 1.0)
        zero_rows, zero_first = meta_ref[5], meta_ref[6]  # an idle item's padding tokens

        @pl.when(live)
        def _out():
            o_ref[out_row, :] = (acc * inv[:, None]).astype(o_ref.dtype)

        @pl.when(zero_rows > 0)
        def _zero():
            padding = zero_first + jnp.where(r_token < zero_rows, r_token, 0)
            o_ref[padding * num_q_heads + head, :] = jnp.zeros((rows_m, head_dim), o_ref.dtype)
    else:

        @pl.when(live)
        def _partial():
            o_ref, m_ref, l_ref = o_refs
            o_ref[out_row, :] = acc * v_scale
            m_ref[out_row] = m
            l_ref[out_row] = l


def _whole(shape: tuple[int, ...]) -> pl.BlockSpec:  # one block: the array
    return pl.BlockSpec(shape, lambda w, h, c: (0,) * len(shape))


def _outputs(splits: int, q_rows: jax.Array) -> tuple[list, list]:
    """(out specs, out shapes): the rows [T * Hq, D] of q, or C partial (acc, m, l) like them."""
    if splits == 1:
        return [_whole(q_rows.shape)], [jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype)]
    num_rows, head_dim = q_rows.shape
    return (
        [
            pl.BlockSpec((None, num_rows, head_dim), lambda w, h, c: (c, 0, 0)),
            *[pl.BlockSpec((None, num_rows), lambda w, h, c: (c, 0))] * 2,
        ],
        [
            jax.ShapeDtypeStruct((splits, num_rows, head_dim), jnp.float32),
            *[jax.ShapeDtypeStruct((splits, num_rows), jnp.float32)] * 2,
        ],
    )


def _call_kernel(
    meta: jax.Array,
    flat_pages: jax.Array,
    scales: jax.Array,
    q_rows: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    kv_cache: jax.Array,
    prev: jax.Array | None,
    *,
    config: GpuConfig,
    group: int,
    interpret: bool,
    **opts: object,
) -> tuple[jax.Array | tuple[jax.Array, ...], jax.Array]:
    """The pallas_call over grid (W, Hkv, C) -> (out rows [T * Hq, D], or the C partial (acc, m,
    l) in that row layout; kv_cache written). `prev` (a call before over the same batch) is the
    output's buffer of a call without splits, its other rows kept."""
    head_dim = q_rows.shape[1]  # padded to a power of two
    num_tokens, num_kv_heads, _ = k_new.shape
    num_pages, page_size, two_hkv, real_head_dim = kv_cache.shape
    splits = config.num_splits
    # A cache row narrower than head_dim (not a power of two): the BlockSpec's last dim
    # overhangs the array and the lowering masks its loads to the real columns. The kernel then
    # only reads the cache; the caller writes this step's K/V with XLA (compiled on an H100, the
    # fused write of an overhanging block corrupted neighbouring slots).
    fused_write = real_head_dim == head_dim
    has_prev = prev is not None and splits == 1
    kernel = functools.partial(
        _attention_kernel,
        page_size=page_size,
        block_q=config.block_q,
        block_kv=config.block_kv,
        group=group,
        gp=common.next_pow2(group),
        num_q_heads=num_kv_heads * group,
        num_splits=splits,
        real_dim=real_head_dim,
        fused_write=fused_write,
        has_prev=has_prev,
        **opts,
    )
    flat_cache = kv_cache.reshape(num_pages * page_size, two_hkv, real_head_dim)
    head_new = pl.BlockSpec((num_tokens, None, head_dim), lambda w, h, c: (0, h, 0))
    head_cache = pl.BlockSpec((flat_cache.shape[0], 2, head_dim), lambda w, h, c: (0, h, 0))
    in_specs = [
        pl.BlockSpec((None, META_WIDTH), lambda w, h, c: (w, 0)),  # meta
        _whole(flat_pages.shape),  # flattened page table
        pl.BlockSpec((None, 2), lambda w, h, c: (h, 0)),  # (k_scale, v_scale) of head h
        _whole(q_rows.shape),
        head_new,
        head_new,
        head_cache,  # q, this step's K and V, cache
    ]
    operands = [meta, flat_pages, scales, q_rows, k_new, v_new, flat_cache]
    out_specs, out_shape = _outputs(splits, q_rows)
    aliases = {}
    if has_prev:  # the call before's output buffer, written in place
        in_specs.append(_whole(q_rows.shape))
        operands.append(prev)
        aliases[len(operands) - 1] = 0
    if fused_write:
        out_specs.append(head_cache)
        out_shape.append(jax.ShapeDtypeStruct(flat_cache.shape, flat_cache.dtype))
        aliases[6] = len(out_shape) - 1
    result = pl.pallas_call(
        kernel,
        grid=(meta.shape[0], num_kv_heads, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=interpret,
        name="ragged_paged_attention_gpu",
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
    )(*operands)
    if fused_write:
        *result, flat_cache = result
    return (result[0] if splits == 1 else tuple(result)), flat_cache.reshape(kv_cache.shape)


def _attend(
    q_rows: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    kv_cache: jax.Array,
    scales: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    prev: jax.Array | None,
    *,
    config: GpuConfig,
    select: jax.Array | None = None,
    num_items: int | None = None,
    **opts: object,
) -> tuple[jax.Array, jax.Array]:
    """One kernel call over the selected sequences (all if `select` is None) -> (out rows
    [T * Hq, D]: theirs written, the others `prev`'s; kv_cache with their K/V written). A call
    without `num_items` also zeroes the padding tokens' rows."""
    num_tokens = k_new.shape[0]
    meta, mine, real = work_list(
        cu_q_lens,
        kv_lens,
        num_seqs,
        num_tokens,
        config.block_q,
        page_indices.shape[1],
        select=select,
        num_items=num_items,
    )
    out, kv_cache = _call_kernel(
        meta,
        page_indices.reshape(-1).astype(jnp.int32),
        scales,
        q_rows,
        k_new,
        v_new,
        kv_cache,
        prev,
        config=config,
        **opts,
    )
    if config.num_splits > 1:  # one XLA fusion merges the splits in the row layout
        rows = lambda x: jnp.repeat(x, q_rows.shape[0] // num_tokens)[:, None]  # noqa: E731
        other = 0 if prev is None else jnp.where(rows(real), prev, 0)
        out = jnp.where(rows(mine), combine(*out).astype(q_rows.dtype), other)
    return out, kv_cache


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "config", "interpret"))
def ragged_paged_attention_gpu(
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
    config: GpuConfig | GpuPaths | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """q [T, Hq, D]; k, v [T, Hkv, D]; kv_cache [P, page, 2*Hkv, D] -> (out [T, Hq, D], kv_cache).

    `config` overrides the block sizes / splits chosen by `default_paths`: one GpuConfig runs one
    call over the whole batch, GpuPaths a decode call and a call for the rest. `interpret=True`
    runs the kernel in the Pallas interpreter (CPU tests)."""
    common.validate_kernel_call(
        "pallas_gpu",
        unsupported_reason,
        q,
        k,
        v,
        kv_cache,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        k_scale,
        v_scale,
        sliding_window,
        soft_cap,
    )
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = kv_cache.shape[1], kv_cache.shape[2] // 2
    group = num_q_heads // num_kv_heads
    num_seqs_max, pages_per_seq = page_indices.shape
    if config is None:
        config = default_paths(
            num_tokens, num_seqs_max, group, num_kv_heads, head_dim, page_size, pages_per_seq, q.dtype
        )
    check_config(config, common.next_pow2(group))
    dp = padded_head_dim(head_dim)

    if dp != head_dim:  # the kernel cannot write an overhanging block: XLA writes, in place
        kv_cache = write_kv(kv_cache, k, v, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale)
    k_new, v_new = new_kv(k, v, kv_cache.dtype, dp, k_scale, v_scale)
    q_rows = jnp.pad(q.reshape(num_tokens * num_q_heads, head_dim), ((0, 0), (0, dp - head_dim)))
    operands = (
        q_rows,
        k_new,
        v_new,
        kv_cache,
        common.kv_scales(kv_cache, k_scale, v_scale),
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
    )
    opts = dict(
        group=group,
        interpret=interpret,
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None,
    )
    if isinstance(config, GpuConfig):
        out, kv_cache = _attend(*operands, None, config=config, **opts)
    else:  # the run-time split: each call writes and reads only its own sequences' slots
        decode = common.real_q_lens(cu_q_lens, num_seqs) == 1
        out, kv_cache = _attend(
            *operands, None, config=config.decode, select=decode, num_items=min(num_tokens, num_seqs_max), **opts
        )
        out, kv_cache = _attend(
            *operands[:3], kv_cache, *operands[4:], out, config=config.rest, select=~decode, num_items=None, **opts
        )
    return out[:, :head_dim].reshape(num_tokens, num_q_heads, head_dim), kv_cache
