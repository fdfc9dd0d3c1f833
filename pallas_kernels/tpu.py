"""Ragged paged attention for TPUs: a Pallas/Mosaic kernel with scalar prefetch and manual DMA.

One call, as the contract in ARCHITECTURE.md: write this step's K/V into the cache and attend.

1. Stored rows (XLA): this step's K/V as the cache holds them (`reference.stored_kv`),
   [T, 2Hkv, D] in the cache dtype; the cache is viewed as [P * page, 2Hkv, D] (a free reshape of
   its leading axes). Both stay in HBM (memory space ANY); the cache is an input/output alias.
2. Layout (XLA): the flattened token axis T is cut into query blocks of `block_q` tokens
   (a power of two >= 16); q becomes [Hkv, nqb, G * bq, D] with rows head-major inside a block
   (row r = g * bq + i is token i of the block, query head g of the group), so a block is one
   plain 2-D matmul operand and a row's token is r & (bq - 1): no reshapes in the kernel.
   Per block, the first and last sequence it touches are found from cu_q_lens (searchsorted).
3. Grid (Hkv, nqb), both parallel: kv head x query block. Scalar prefetch (SMEM): kv_lens, the
   flattened page table, cu_q_lens, num_seqs, and the blocks' first/last sequences. A grid step
   loops over the sequences its block touches; for each it walks the keys its rows may see in
   blocks of `pages_per_block * page_size`, first the cached context (each page brought in by two
   DMAs, K rows at 2h and V rows at 2h + 1), then this step's tokens (two DMAs of contiguous
   stored rows; never from the cache, which is being written). Blocks are double buffered:
   block j+1's DMAs are in flight while block j is computed. Pages past the context are replaced
   by its last page, so only owned pages are read.
4. KV write, fused: the grid steps of kv head 0 copy their block's real tokens, all heads at
   once ([1, 2Hkv, D] each), from the stored rows into their cache slots by DMA, and wait for
   them before the step ends. No step reads a slot that any step writes, so the writes cannot
   race the reads even when the two TensorCores of a chip share the grid. (XLA's own scatter on
   TPU updates one row at a time; the DMAs are issued back to back and overlap the attention.)
5. Math: one float32 online softmax (m, l, acc) per block row across all its sequences. Rows
   that are not the current sequence's are masked; a finite mask value makes a row's not-yet-real
   statistics harmless (the first real score scales them by exp(MASK - real) == 0). V past
   the real keys is zeroed so stale/NaN slots cannot leak through p == 0. Rows of padding tokens
   are written as zeros.

Supports bf16/f32 q, an unquantized cache of q's dtype or an int8/fp8 cache with per-kv-head
scales (dequantized in VMEM), head_dim 64/128/256, page_size a multiple of the cache dtype's
sublane packing, sliding window, soft cap. Runs under TPU interpret mode on the CPU (no ref
reshapes, no strided ref loads, static DMA shapes) and lowers for TPU from the CPU. No real TPU
has compiled it yet; the open risks are the per-head DMAs (`.at[rows, 2h, :]` slices the
second-minor axis of a tiled HBM array) and the SMEM size of the flattened page table.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import common
from pallas_kernels.reference import stored_kv

_FLOAT_DTYPES = (jnp.bfloat16, jnp.float32)


@dataclasses.dataclass(frozen=True)
class TpuConfig:
    block_q: int          # query tokens per block over the flattened T axis (power of two >= 16)
    pages_per_block: int  # pages per KV step; block_kv = pages_per_block * page_size
    vmem_limit_bytes: int | None = None


def _sublane_rows(dtype) -> int:
    return 32 // jnp.dtype(dtype).itemsize  # rows per (sublane) tile: 8 for 32-bit, 16, 32


def unsupported_reason(q, kv_cache, page_indices) -> str | None:
    head_dim = q.shape[-1]
    page_size = kv_cache.shape[1]
    if (reason := common.dtype_mismatch(q, kv_cache, _FLOAT_DTYPES)) is not None:
        return reason
    if head_dim not in (64, 128, 256):
        return f"head_dim={head_dim} (want 64, 128 or 256)"
    if page_size % _sublane_rows(kv_cache.dtype):
        return (f"page_size={page_size} (want a multiple of {_sublane_rows(kv_cache.dtype)} "
                f"for {jnp.dtype(kv_cache.dtype).name})")
    return None


def default_config(num_tokens, num_seqs, group, page_size, pages_per_seq):
    if num_tokens <= 2 * num_seqs:  # decode-like: one token per sequence, keep wasted rows few
        block_q = 16
    else:
        block_q = max(16, min(256, common.next_pow2(-(-256 // group))))
    block_q = min(block_q, max(16, common.next_pow2(num_tokens)))
    pages_per_block = max(1, min(pages_per_seq, 512 // page_size))
    return TpuConfig(block_q, pages_per_block)


def _attention_kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref, pages_ref, cu_q_lens_ref, num_seqs_ref, first_seq_ref, last_seq_ref,
    # inputs: per-head scales (SMEM), q block (VMEM), stored new rows and the cache (HBM)
    scales_ref, q_ref, new_hbm, cache_hbm,
    # outputs: out block (VMEM), the cache again (HBM, aliased to cache_hbm)
    o_ref, cache_out,
    # scratch
    k_buf, v_buf, sems, write_sem,
    *, block_q, pages_per_block, pages_per_seq, sm_scale, sliding_window, soft_cap, precision,
):
    rows_m, head_dim = q_ref.shape  # M = G * bq
    _, block_kv, _ = k_buf.shape
    page_size = block_kv // pages_per_block
    h, qb = pl.program_id(0), pl.program_id(1)
    block_start = qb * block_q
    k_scale, v_scale = scales_ref[2 * h], scales_ref[2 * h + 1]
    real_end = cu_q_lens_ref[num_seqs_ref[0]]

    q = q_ref[...]  # [M, D]
    row_tok = block_start + (lax.broadcasted_iota(jnp.int32, (rows_m, block_kv), 0) & (block_q - 1))
    col = lax.broadcasted_iota(jnp.int32, (rows_m, block_kv), 1)  # [M, N]
    v_row = lax.broadcasted_iota(jnp.int32, (block_kv, head_dim), 0)  # [N, D]

    def slot_of(seq, pos):  # cache row of position `pos` of `seq`; non-negative: lax.div/rem
        page = pages_ref[seq * pages_per_seq + lax.div(pos, page_size)]
        return page * page_size + lax.rem(pos, page_size)

    def cached_copies(seq, blk, slot, ctx_len):
        """K and V rows of head h for cached block `blk`: two DMAs per page; pages past the
        context repeat its last page (one the sequence owns)."""
        last = lax.div(ctx_len - 1, page_size)
        out = []
        for i in range(pages_per_block):
            first = slot_of(seq, jnp.minimum(blk * pages_per_block + i, last) * page_size)
            src, dst = pl.ds(first, page_size), pl.ds(i * page_size, page_size)
            out.append(pltpu.make_async_copy(cache_hbm.at[src, 2 * h, :], k_buf.at[slot, dst],
                                             sems.at[slot]))
            out.append(pltpu.make_async_copy(cache_hbm.at[src, 2 * h + 1, :], v_buf.at[slot, dst],
                                             sems.at[slot]))
        return out

    def new_copies(token, slot):
        """K and V rows of head h of tokens [token, token + N) of this step: two DMAs."""
        src = pl.ds(token, block_kv)
        return [pltpu.make_async_copy(new_hbm.at[src, 2 * h, :], k_buf.at[slot], sems.at[slot]),
                pltpu.make_async_copy(new_hbm.at[src, 2 * h + 1, :], v_buf.at[slot], sems.at[slot])]

    def attend_block(slot, carry, first, end, row_pos, in_seq):  # m, l [M, 1]; acc [M, D]
        k = k_buf[slot].astype(q.dtype)  # [N, D]
        v = v_buf[slot].astype(q.dtype)
        s = common.block_scores(q, k, scale=sm_scale * k_scale, soft_cap=soft_cap,
                                precision=precision)  # [M, N]
        kpos = first + col
        mask = in_seq & (kpos <= row_pos) & (kpos < end)
        if sliding_window is not None:
            mask = mask & (row_pos - kpos < sliding_window)
        s = jnp.where(mask, s, common.MASK_VALUE)
        v = jnp.where(first + v_row < end, v, jnp.zeros_like(v))  # stale/NaN slots
        return common.online_softmax_update(carry, s, v, precision=precision, keepdims=True)

    def write_new_kv(seq, lo, hi, delta):
        """Copy tokens [lo, hi) of `seq` (all heads) into their cache slots; waited at the end."""
        def start(t, _):
            pltpu.make_async_copy(new_hbm.at[pl.ds(t, 1)],
                                  cache_out.at[pl.ds(slot_of(seq, t + delta), 1)], write_sem).start()
        lax.fori_loop(lo, hi, start, None)

    def attend_sequence(seq, carry):
        q_start, q_end = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1]
        lo = jnp.maximum(q_start, block_start)  # this block's tokens of seq: [lo, hi)
        hi = jnp.minimum(q_end, block_start + block_q)
        delta = kv_lens_ref[seq] - q_end  # position of token t is t + delta
        ctx_len = q_start + delta  # cached positions [0, ctx_len); this step's [ctx_len, kv_end)
        kv_end = hi + delta
        kv_start = 0 if sliding_window is None else jnp.maximum(lo + delta - sliding_window + 1, 0)
        live = hi > lo
        a_lo = lax.div(kv_start, block_kv)
        n_a = jnp.where(live & (ctx_len > kv_start),
                        lax.div(ctx_len + block_kv - 1, block_kv) - a_lo, 0)
        b_pos = jnp.maximum(ctx_len, kv_start)  # first key of this step the rows may see
        n_b = jnp.where(live, lax.div(kv_end - b_pos + block_kv - 1, block_kv), 0)
        in_seq = (row_tok >= lo) & (row_tok < hi)
        row_pos = row_tok + delta

        @pl.when(live & (h == 0))
        def _():
            write_new_kv(seq, lo, hi, delta)

        def copies(i, slot, action):  # block i < n_a: cached block a_lo + i; else this step's
            @pl.when(i < n_a)
            def _():
                for c in cached_copies(seq, a_lo + i, slot, ctx_len):
                    getattr(c, action)()

            @pl.when(i >= n_a)
            def _():
                for c in new_copies(b_pos - delta + (i - n_a) * block_kv, slot):
                    getattr(c, action)()

        @pl.when(n_a + n_b > 0)
        def _():
            copies(0, 0, "start")

        def kv_step(i, carry):
            slot = lax.rem(i, 2)
            copies(i, slot, "wait")

            @pl.when(i + 1 < n_a + n_b)
            def _():
                copies(i + 1, 1 - slot, "start")

            cached = i < n_a
            first = jnp.where(cached, (a_lo + i) * block_kv, b_pos + (i - n_a) * block_kv)
            end = jnp.where(cached, ctx_len, kv_end)
            return attend_block(slot, carry, first, end, row_pos, in_seq)

        return lax.fori_loop(0, n_a + n_b, kv_step, carry)

    init = (jnp.full((rows_m, 1), common.MASK_VALUE, jnp.float32),
            jnp.zeros((rows_m, 1), jnp.float32), jnp.zeros((rows_m, head_dim), jnp.float32))
    _, l, acc = lax.fori_loop(first_seq_ref[qb], last_seq_ref[qb] + 1, attend_sequence, init)
    row_tok1 = block_start + (lax.broadcasted_iota(jnp.int32, (rows_m, 1), 0) & (block_q - 1))
    row_real = (row_tok1 < real_end) & (l > 0)  # [M, 1]
    out = acc * (v_scale / jnp.where(row_real, l, 1.0))
    o_ref[...] = jnp.where(row_real, out, 0.0).astype(o_ref.dtype)

    @pl.when(h == 0)
    def _():  # every write DMA this step started, waited by count (they are all one size)
        written = jnp.clip(real_end - block_start, 0, block_q)
        done = pltpu.make_async_copy(new_hbm.at[pl.ds(0, 1)], cache_out.at[pl.ds(0, 1)], write_sem)
        lax.fori_loop(0, written, lambda _, c: (done.wait(), c)[1], None)


def _block_sequences(cu_q_lens, num_seqs, num_blocks, block_q):
    """First and last sequence touching each query block ([nqb] each; last < first if none)."""
    n = common.scalar_num_seqs(num_seqs)[0]
    starts = jnp.arange(num_blocks, dtype=jnp.int32) * block_q
    ends = jnp.minimum(starts + block_q, cu_q_lens[n])
    first = jnp.searchsorted(cu_q_lens[1:], starts, side="right").astype(jnp.int32)
    last = jnp.searchsorted(cu_q_lens[1:], ends - 1, side="right").astype(jnp.int32)
    last = jnp.where(ends > starts, jnp.minimum(last, n - 1), -1)
    return jnp.minimum(first, jnp.maximum(n - 1, 0)), last


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "config", "interpret"))
def ragged_paged_attention_tpu(
    q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
    *, sm_scale, sliding_window=None, soft_cap=None, k_scale=None, v_scale=None,
    config: TpuConfig | None = None, interpret=None,
):
    """q [T, Hq, D]; k, v [T, Hkv, D]; kv_cache [P, page, 2*Hkv, D] -> (out [T, Hq, D], kv_cache).

    `interpret`: None/False compiles for the TPU; a `pltpu.InterpretParams` runs the TPU
    interpreter (so does an enclosing `pltpu.force_tpu_interpret_mode`)."""
    common.check_contract(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
                          k_scale, v_scale)
    common.check_options(sliding_window, soft_cap)
    reason = unsupported_reason(q, kv_cache, page_indices)
    if reason is not None:
        raise common.UnsupportedShape(f"pallas_tpu cannot take {reason}")
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, two_hkv, _ = kv_cache.shape
    num_kv_heads = two_hkv // 2
    group = num_q_heads // num_kv_heads
    num_seqs_max, pages_per_seq = page_indices.shape
    if config is None:
        config = default_config(num_tokens, num_seqs_max, group, page_size, pages_per_seq)
    bq, ppb = config.block_q, config.pages_per_block
    if bq < 16 or bq & (bq - 1):
        raise common.UnsupportedShape(f"pallas_tpu block_q={bq} must be a power of two >= 16")
    num_blocks = pl.cdiv(num_tokens, bq)
    rows_m = group * bq
    block_kv = ppb * page_size

    t_pad = num_blocks * bq - num_tokens
    q_blocks = jnp.pad(q, ((0, t_pad), (0, 0), (0, 0)))
    q_blocks = q_blocks.reshape(num_blocks, bq, num_kv_heads, group, head_dim)
    q_blocks = q_blocks.transpose(2, 0, 3, 1, 4).reshape(num_kv_heads, num_blocks, rows_m, head_dim)
    first_seq, last_seq = _block_sequences(cu_q_lens, num_seqs, num_blocks, bq)
    scalars = (kv_lens.astype(jnp.int32), page_indices.reshape(-1).astype(jnp.int32),
               cu_q_lens.astype(jnp.int32), common.scalar_num_seqs(num_seqs), first_seq, last_seq)
    scales = common.kv_scales(kv_cache, k_scale, v_scale).reshape(-1)  # [2 * Hkv]
    # Stored rows, padded so that a block of keys starting at any real token stays in bounds.
    new_rows = jnp.pad(stored_kv(k, v, kv_cache.dtype, k_scale, v_scale),
                       ((0, block_kv), (0, 0), (0, 0)))
    flat_cache = kv_cache.reshape(num_pages * page_size, two_hkv, head_dim)

    kernel = functools.partial(
        _attention_kernel, block_q=bq, pages_per_block=ppb, pages_per_seq=pages_per_seq,
        sm_scale=float(sm_scale), sliding_window=sliding_window, soft_cap=soft_cap,
        precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None)
    block = pl.BlockSpec((None, None, rows_m, head_dim), lambda h, b, *_: (h, b, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars),
        grid=(num_kv_heads, num_blocks),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), block, hbm, hbm],
        out_specs=[block, hbm],
        scratch_shapes=[pltpu.VMEM((2, block_kv, head_dim), kv_cache.dtype),
                        pltpu.VMEM((2, block_kv, head_dim), kv_cache.dtype),
                        pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA],
    )
    out_blocks, flat_cache = pl.pallas_call(
        kernel, grid_spec=grid_spec, name="ragged_paged_attention_tpu",
        out_shape=[jax.ShapeDtypeStruct((num_kv_heads, num_blocks, rows_m, head_dim), q.dtype),
                   jax.ShapeDtypeStruct(flat_cache.shape, flat_cache.dtype)],
        input_output_aliases={len(scalars) + 3: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                                             vmem_limit_bytes=config.vmem_limit_bytes),
        interpret=interpret or False,
    )(*scalars, scales, q_blocks, new_rows, flat_cache)

    out = out_blocks.reshape(num_kv_heads, num_blocks, group, bq, head_dim)
    out = out.transpose(1, 3, 0, 2, 4).reshape(num_blocks * bq, num_q_heads, head_dim)
    return out[:num_tokens], flat_cache.reshape(kv_cache.shape)
