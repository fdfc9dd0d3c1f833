"""The GPU attention kernel (Pallas on the Triton lowering) and the blocks of its pallas_call.

gpu.py makes the call (steps 3-5 of its docstring); this module is what runs inside it.

- Grid (W, Hkv, C): work item x kv head x KV split. A program gathers its q rows [bq * Gp, D]
  (the bq tokens x the G query heads of kv head h, G padded to the power of two Gp, rows >= 16
  for Triton's dots) and runs a float32 online softmax over its keys in blocks of `block_kv`
  positions, aligned from the sliding window's start. Cached positions [0, ctx_len) are gathered
  from the cache by slot through the flattened page table (an ordinary input: Triton has no
  scalar prefetch); this step's [ctx_len, kv_end) from the K/V inputs, never from the cache (so
  the fused write is safe: Triton has no barrier across programs). The block that straddles
  ctx_len reads both, so a decode token costs no extra block.
- KV write, fused: the split-0 program of each (item, head) stores its rows' K and V into their
  slots of the cache, an input/output alias (in place under donation). A head_dim that is not a
  power of two is padded inside the kernel; then XLA writes the K/V and the kernel only reads.
- Output: each program stores its rows straight into out [T * Hq, D]. Rows past the item's
  tokens or the group repeat a real row's values, so no load or store needs a mask. Split-K
  (flash-decoding, C > 1 programs share one item's KV blocks) stores unnormalised (acc, m, l) in
  the same rows, which gpu.py merges.

`call_specs` lays the operands out for the grid: program (w, h, c) sees meta row w, the whole
page table and q rows, head h's scales, K/V and cache rows, and the output buffer of a call
before (aliased to out); its outputs are out (or split c's partials) and the cache (aliased).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.common import Ref
from pallas_kernels.gpu_work import META_WIDTH


def attention_kernel(
    meta_ref: Ref,
    pages_ref: Ref,
    scale_ref: Ref,
    q_ref: Ref,
    k_ref: Ref,
    v_ref: Ref,
    cache_ref: Ref,
    *refs: Ref,
    page_size: int,
    block_q: int,
    block_kv: int,
    group: int,
    gp: int,
    num_q_heads: int,
    num_splits: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    precision: lax.Precision | None,
    real_dim: int,
    fused_write: bool,
    has_prev: bool,
) -> None:
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

    if cache_out is not None:  # the fused KV write (see gpu._call_kernel)

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


@dataclasses.dataclass(frozen=True)
class CallSpecs:
    """What pl.pallas_call takes besides the kernel and the grid."""

    operands: list[jax.Array]
    in_specs: list[pl.BlockSpec]
    out_specs: list[pl.BlockSpec]
    out_shape: list[jax.ShapeDtypeStruct]
    aliases: dict[int, int]  # input_output_aliases: operand index -> output index


def call_specs(operands: list[jax.Array], prev: jax.Array | None, splits: int, fused_write: bool) -> CallSpecs:
    """`operands` (meta, flattened page table, scales, q rows, this step's K and V, flattened
    cache), with `prev` (a call before's output buffer, written in place) appended if given, and
    the cache among the outputs (aliased) under `fused_write`."""
    _, flat_pages, _, q_rows, k_new, _, flat_cache = operands
    head_dim = q_rows.shape[1]  # padded to a power of two
    head_new = pl.BlockSpec((k_new.shape[0], None, head_dim), lambda w, h, c: (0, h, 0))
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
    operands = list(operands)
    out_specs, out_shape = _outputs(splits, q_rows)
    aliases = {}
    if prev is not None:  # the call before's output buffer, written in place
        in_specs.append(_whole(q_rows.shape))
        operands.append(prev)
        aliases[len(operands) - 1] = 0
    if fused_write:
        out_specs.append(head_cache)
        out_shape.append(jax.ShapeDtypeStruct(flat_cache.shape, flat_cache.dtype))
        aliases[6] = len(out_shape) - 1
    return CallSpecs(operands, in_specs, out_specs, out_shape, aliases)
