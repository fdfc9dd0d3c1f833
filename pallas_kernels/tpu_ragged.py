"""The TPU's ragged kernel (the mixed and prefill paths of tpu.py): scalar prefetch, manual DMA.

One call writes a range of tokens' K/V into the cache and attends: the whole batch, or the
tokens of one path (tpu.py gathers each path's sequences into one contiguous range).

1. Stored rows (XLA): this step's K/V as the cache holds them (`kv_write.stored_kv`),
   [T, 2Hkv, D] in the cache dtype; the cache is viewed as [P * page, 2Hkv, D] (a free reshape of
   its leading axes: the tiled minor axes are untouched). Both stay in HBM (memory space ANY);
   the cache is an input/output alias. A page, every head's K (row 2h) and V (row 2h + 1) of
   its tokens, is one contiguous run of HBM.
2. Layout (XLA): the flattened token axis T is cut into query blocks of `block_q` tokens
   (a power of two >= 16); q becomes [nqb, Hkv, G * bq, D] with rows head-major inside a kv
   head's block (row r = g * bq + i is token i of the block, query head g of the group), so
   each kv head's block is one plain 2-D matmul operand and a row's token is r & (bq - 1).
   Per block, the first and last sequence it touches are found from cu_q_lens (searchsorted).
3. Grid (nqb,), parallel: one query block, every kv head. Scalar prefetch (SMEM): kv_lens, the
   flattened page table, cu_q_lens, the call's token range, and the blocks' first/last
   sequences. Steps past the range do nothing (their blocks still move: a parallel grid visits
   each block once). A grid step
   loops over the sequences its block touches; for each it walks the keys its rows may see in
   blocks of N = `pages_per_block * page_size` positions, fetched a whole page at a time (all
   kv heads: one contiguous DMA, never a per-head slice of the tiled HBM cache): a cached page
   from the cache, a chunk of this step's keys from the stored rows (never from the cache,
   which is being written), the chunk that straddles the cached length by both, into separate
   [2, N, 2Hkv, D] buffers that are selected per key. Each kv head then takes its K and V rows
   out of the VMEM buffers by strided loads (tpu_rows.py). Chunks past the causal end are not fetched, so
   a decode token costs one page. Blocks are double buffered: block j+1's DMAs are in flight
   while block j is computed.
4. KV write, fused: each grid step copies its block's real tokens, all heads at once
   ([1, 2Hkv, D] each), from the stored rows into their cache slots by DMA, and waits for them before
   the step ends. No step reads a slot that any step writes, so the writes cannot race the
   reads even when the two TensorCores of a chip share the grid. The DMAs are issued back to
   back and overlap the attention, where a separate XLA scatter would run before it.
5. Math: one float32 online softmax (m, l, acc) per kv head and block row, across all its
   sequences, kept in VMEM scratch ([Hkv, M, 1], [Hkv, M, 1], [Hkv, M, D]). Rows that are not
   the current sequence's are masked; a finite mask value makes a row's not-yet-real statistics
   harmless (the first real score scales them by exp(MASK - real) == 0). V past the real keys
   is zeroed so stale/NaN slots cannot leak through p == 0. Rows of padding tokens are written
   as zeros.

Supports bf16/f32 q, an unquantized cache of q's dtype or an int8/fp8 cache with per-kv-head
scales (dequantized in VMEM), head_dim 64/128/256, page_size a multiple of the cache dtype's
sublane packing, sliding window, soft cap. Runs under TPU interpret mode on the CPU (static
DMA shapes; the interpreter reads a head's rows from the loaded buffer, tpu_rows.py) and
compiles for v5e / v6e / 7x from the CPU (tests/pallas_kernels/test_tpu_compile.py). No real
TPU has run it yet.
The shape limits and block sizes (`unsupported_reason`, `TpuConfig`) live in tpu_config.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import common, tpu_layout, tpu_rows
from pallas_kernels.tpu_config import KV_SCRATCH_BUFFERS, TpuConfig, kv_scratch_shape, softmax_state_shapes


def _attention_kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,
    pages_ref,
    cu_q_lens_ref,
    bounds_ref,
    first_seq_ref,
    last_seq_ref,
    # inputs: per-head scales (SMEM), q block (VMEM), stored new rows and the cache (HBM)
    scales_ref,
    q_ref,
    new_hbm,
    cache_hbm,
    # outputs: out block (VMEM), the cache again (HBM, aliased to cache_hbm)
    o_ref,
    cache_out,
    # scratch: [2, N, 2Hkv, D] double buffers of whole tokens (every head's K and V) from the
    # cache and the new rows; float32 online-softmax state per kv head; DMA semaphores
    cached_buf,
    new_buf,
    m_ref,
    l_ref,
    acc_ref,
    sems,
    write_sem,
    *,
    block_q,
    pages_per_block,
    pages_per_seq,
    sm_scale,
    sliding_window,
    soft_cap,
    precision,
    interpret_rows,
):
    num_kv_heads, rows_m, head_dim = q_ref.shape  # M = G * bq
    block_kv = cached_buf.shape[1]
    page_size = block_kv // pages_per_block
    qb = pl.program_id(0)
    block_start = bounds_ref[0] + qb * block_q  # this call's tokens: [bounds[0], bounds[1])
    real_end = bounds_ref[1]

    row_tok = block_start + (lax.broadcasted_iota(jnp.int32, (rows_m, block_kv), 0) & (block_q - 1))
    col = lax.broadcasted_iota(jnp.int32, (rows_m, block_kv), 1)  # [M, N]
    key_row = lax.broadcasted_iota(jnp.int32, (block_kv, head_dim), 0)  # [N, D]

    def slot_of(seq, pos):  # cache row of position `pos` of `seq`; non-negative: lax.div/rem
        page = pages_ref[seq * pages_per_seq + lax.div(pos, page_size)]
        return page * page_size + lax.rem(pos, page_size)

    def block_copies(seq, blk, slot, ctx_len, kv_end, delta, action):
        """Start or wait the DMAs of key block `blk` (positions blk * N + [0, N)), a whole page
        (all kv heads' K and V, contiguous in HBM) at a time: cached chunks from their page,
        chunks of this step from the stored rows (both for the chunk that straddles ctx_len);
        chunks past kv_end are not fetched."""
        for i in range(pages_per_block):
            p0 = blk * block_kv + i * page_size
            dst = pl.ds(i * page_size, page_size)

            @pl.when(p0 < ctx_len)
            def _copy_cached():
                src = pl.ds(slot_of(seq, p0), page_size)
                getattr(pltpu.make_async_copy(cache_hbm.at[src], cached_buf.at[slot, dst], sems.at[slot]), action)()

            @pl.when((p0 + page_size > ctx_len) & (p0 < kv_end))
            def _copy_new():  # new rows carry page_size rows of padding in front: index >= 0
                src = pl.ds(page_size + p0 - delta, page_size)
                getattr(pltpu.make_async_copy(new_hbm.at[src], new_buf.at[slot, dst], sems.at[slot]), action)()

    def attend_block(blk, slot, ctx_len, kv_end, row_pos, in_seq):
        """Every kv head's online-softmax state advanced by key block `blk`. Unfetched chunks
        hold stale VMEM: never selected."""
        first = blk * block_kv
        cached = first + key_row < ctx_len  # [N, D]
        kpos = first + col
        mask = in_seq & (kpos <= row_pos) & (kpos < kv_end)
        if sliding_window is not None:
            mask = mask & (row_pos - kpos < sliding_window)
        for h in range(num_kv_heads):
            q = q_ref[h]  # [M, D]
            (k_cached, v_cached), (k_new, v_new) = (
                tpu_rows.head_kv(buf, slot, h, q.dtype, interpret=interpret_rows) for buf in (cached_buf, new_buf)
            )
            k, v = jnp.where(cached, k_cached, k_new), jnp.where(cached, v_cached, v_new)
            s = common.block_scores(
                q, k, scale=sm_scale * scales_ref[2 * h], soft_cap=soft_cap, precision=precision
            )  # [M, N]
            s = jnp.where(mask, s, common.MASK_VALUE)
            v = jnp.where(first + key_row < kv_end, v, 0)  # stale VMEM, NaN too
            m, l, acc = common.online_softmax_update(
                (m_ref[h], l_ref[h], acc_ref[h]), s, v, precision=precision, keepdims=True
            )
            m_ref[h], l_ref[h], acc_ref[h] = m, l, acc

    def write_new_kv(seq, lo, hi, delta):
        """Copy tokens [lo, hi) of `seq` (all heads) into their cache slots; waited at the end."""

        def start(t, _):
            pltpu.make_async_copy(
                new_hbm.at[pl.ds(page_size + t, 1)], cache_out.at[pl.ds(slot_of(seq, t + delta), 1)], write_sem
            ).start()

        lax.fori_loop(lo, hi, start, None)

    def attend_sequence(seq, _):
        q_start, q_end = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1]
        lo = jnp.maximum(q_start, block_start)  # this block's tokens of seq: [lo, hi)
        hi = jnp.minimum(q_end, block_start + block_q)
        delta = kv_lens_ref[seq] - q_end  # position of token t is t + delta
        ctx_len = q_start + delta  # cached positions [0, ctx_len); this step's [ctx_len, kv_end)
        kv_end = hi + delta
        kv_start = 0 if sliding_window is None else jnp.maximum(lo + delta - sliding_window + 1, 0)
        live = hi > lo
        blk_lo = lax.div(kv_start, block_kv)
        blk_hi = jnp.where(live, lax.div(kv_end + block_kv - 1, block_kv), blk_lo)
        in_seq = (row_tok >= lo) & (row_tok < hi)
        row_pos = row_tok + delta
        copies = functools.partial(block_copies, seq, ctx_len=ctx_len, kv_end=kv_end, delta=delta)

        @pl.when(live)
        def _write_new():
            write_new_kv(seq, lo, hi, delta)

        @pl.when(blk_lo < blk_hi)
        def _start_first():
            copies(blk_lo, 0, action="start")

        def kv_step(blk, _):
            slot = lax.rem(blk - blk_lo, 2)
            copies(blk, slot, action="wait")

            @pl.when(blk + 1 < blk_hi)
            def _start_next():
                copies(blk + 1, 1 - slot, action="start")

            attend_block(blk, slot, ctx_len, kv_end, row_pos, in_seq)

        lax.fori_loop(blk_lo, blk_hi, kv_step, None)

    m_ref[...] = jnp.full(m_ref.shape, common.MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    lax.fori_loop(first_seq_ref[qb], last_seq_ref[qb] + 1, attend_sequence, None)
    row_tok1 = block_start + (lax.broadcasted_iota(jnp.int32, (rows_m, 1), 0) & (block_q - 1))
    for h in range(num_kv_heads):
        l = l_ref[h]
        row_real = (row_tok1 < real_end) & (l > 0)  # [M, 1]
        out = acc_ref[h] * (scales_ref[2 * h + 1] / jnp.where(row_real, l, 1.0))
        o_ref[h] = jnp.where(row_real, out, 0.0).astype(o_ref.dtype)

    # Every write DMA this step started, waited by count (they are all one size).
    written = jnp.clip(real_end - block_start, 0, block_q)
    done = pltpu.make_async_copy(new_hbm.at[pl.ds(0, 1)], cache_out.at[pl.ds(0, 1)], write_sem)
    lax.fori_loop(0, written, lambda _, c: (done.wait(), c)[1], None)


def attention(
    scalars: tuple[jax.Array, ...],
    scales: jax.Array,
    q_blocks: jax.Array,
    new_rows: jax.Array,
    kv_cache: jax.Array,
    *,
    config: TpuConfig,
    pages_per_seq: int,
    interpret: bool | pltpu.InterpretParams | None,
    **opts: object,
) -> tuple[jax.Array, jax.Array]:
    """The pallas_call over grid (nqb,) -> (out blocks like q_blocks, kv_cache written).

    scalars: kv_lens, the flattened page table, cu_q_lens, bounds i32[2] (first token, end
    token), and the first / last sequence of each block; q_blocks [nqb, Hkv, M, D]."""
    num_blocks, num_kv_heads, rows_m, head_dim = q_blocks.shape
    page_size = kv_cache.shape[1]
    kernel = functools.partial(
        _attention_kernel,
        block_q=config.block_q,
        pages_per_block=config.pages_per_block,
        pages_per_seq=pages_per_seq,
        interpret_rows=tpu_rows.interpreted(interpret),
        **opts,
    )
    block = pl.BlockSpec((None, num_kv_heads, rows_m, head_dim), lambda b, *_: (b, 0, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    kv_buf = pltpu.VMEM(kv_scratch_shape(config, page_size, num_kv_heads, head_dim), kv_cache.dtype)
    group = rows_m // config.block_q
    stats = [pltpu.VMEM(shape, jnp.float32) for shape in softmax_state_shapes(config, num_kv_heads, group, head_dim)]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars),
        grid=(num_blocks,),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), block, hbm, hbm],
        out_specs=[block, hbm],
        scratch_shapes=[kv_buf] * KV_SCRATCH_BUFFERS + stats + [pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA],
    )
    return tpu_layout.call_in_place(
        kernel,
        grid_spec,
        "ragged_paged_attention_tpu",
        scalars,
        scales,
        q_blocks,
        new_rows,
        kv_cache,
        config.vmem_limit_bytes,
        interpret,
    )
