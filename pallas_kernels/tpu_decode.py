"""The TPU's decode kernel (the decode path of tpu.py): sequences of one query token each.

A decode token sees every cached position of its sequence and itself, so the kernel needs no
causal mask, no query blocks cut across sequences and no choice between cached and new keys:

1. Layout (XLA, tpu.py): the path's B sequences per grid step, q as [nb, Hkv, B, G, D] (a kv
   head's G query heads of one token are one [G, D] matmul operand) and this step's stored
   K/V rows as [nb, B, 2Hkv, D] in the cache dtype, both VMEM blocks. The cache stays in HBM
   (memory space ANY), an input/output alias viewed as [P * page, 2Hkv, D].
2. Grid (nb,), parallel: B sequences. Scalar prefetch (SMEM): kv_lens, the flattened page
   table and the count of decode sequences; steps past it do nothing (their blocks still move:
   a parallel grid visits each block once).
3. Per sequence: its token's K/V is copied from the VMEM block into its cache slot by DMA
   (waited at the end of the step), its own score starts the float32 online softmax (so no
   mask value is needed), and its cached positions [start, kv_len - 1) are walked in KV steps
   of N = `pages_per_block * page_size` positions, a whole page (every kv head) per DMA into a
   [2, N, 2Hkv, D] double buffer. The next KV step is in flight while one is computed, across
   sequences too: a sequence's last step starts the next sequence's first.
4. Each kv head takes its K and V rows out of the buffer by strided loads of the buffer viewed
   as rows (tpu_rows.py); positions past the cached length are masked and their V zeroed
   (stale VMEM, NaN too).

Supports what the ragged kernel does (tpu_ragged.py): bf16/f32 q, an unquantized or int8/fp8
cache with per-kv-head scales, head_dim 64/128/256, sliding window, soft cap.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import common, tpu_layout, tpu_rows
from pallas_kernels.tpu_config import DecodeConfig


def _decode_kernel(
    kv_lens_ref,
    pages_ref,
    count_ref,  # scalar prefetch (SMEM)
    scales_ref,
    q_ref,
    new_ref,
    cache_hbm,  # per-head scales (SMEM), q and new rows [1, B, 2Hkv, D] (VMEM), cache (HBM)
    o_ref,
    cache_out,  # out block (VMEM), the cache again (HBM, aliased to cache_hbm)
    kv_buf,
    sems,
    write_sem,  # scratch: [2, N, 2Hkv, D] key buffer, DMA semaphores
    *,
    page_size,
    pages_per_seq,
    sm_scale,
    sliding_window,
    soft_cap,
    precision,
    interpret_rows,
):
    num_kv_heads, seqs_per_block, group, head_dim = q_ref.shape
    block_kv = kv_buf.shape[1]
    first = pl.program_id(0) * seqs_per_block
    count = jnp.clip(count_ref[0] - first, 0, seqs_per_block)  # this step's sequences
    col = lax.broadcasted_iota(jnp.int32, (group, block_kv), 1)
    key_row = lax.broadcasted_iota(jnp.int32, (block_kv, head_dim), 0)

    def slot_of(seq, pos):  # cache row of position `pos` of `seq`
        return pages_ref[seq * pages_per_seq + lax.div(pos, page_size)] * page_size + lax.rem(pos, page_size)

    def blocks(i):
        """Sequence i's index, cached length and KV steps [lo, hi). Read for the sequence after
        the last one too (then unused): its index is clamped into the tables."""
        seq = jnp.minimum(first + i, kv_lens_ref.shape[0] - 1)
        ctx = kv_lens_ref[seq] - 1  # cached positions [0, ctx); the token's own at ctx
        start = 0 if sliding_window is None else jnp.maximum(ctx - sliding_window + 1, 0)
        return seq, ctx, lax.div(start, block_kv), lax.div(ctx + block_kv - 1, block_kv)

    def copies(seq, ctx, blk, slot, action):
        """Start or wait the page DMAs of KV step `blk` of `seq` (its cached pages only)."""

        def page(j, _):
            p0 = blk * block_kv + j * page_size

            @pl.when(p0 < ctx)
            def _copy_page():
                src = cache_hbm.at[pl.ds(slot_of(seq, p0), page_size)]
                dst = kv_buf.at[slot, pl.ds(j * page_size, page_size)]
                getattr(pltpu.make_async_copy(src, dst, sems.at[slot]), action)()

        lax.fori_loop(0, block_kv // page_size, page, None)

    def start_first(i, slot):
        seq, ctx, lo, hi = blocks(i)

        @pl.when((i < count) & (lo < hi))
        def _start():
            copies(seq, ctx, lo, slot, "start")

    def own_token(i, h, q):
        """The softmax state seeded with the token's own key: m = its score, l = 1, acc = v."""
        k = new_ref[0, i, pl.ds(2 * h, 1), :].astype(jnp.float32)  # [1, D]
        v = new_ref[0, i, pl.ds(2 * h + 1, 1), :].astype(jnp.float32)
        s = jnp.sum(q.astype(jnp.float32) * k, axis=1, keepdims=True) * (sm_scale * scales_ref[2 * h])
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        return s, jnp.ones_like(s), jnp.broadcast_to(v, (group, head_dim))

    def attend(i, ctx, blk, slot, state):
        kpos = blk * block_kv + col
        mask = kpos < ctx
        if sliding_window is not None:
            mask = mask & (ctx - kpos < sliding_window)
        real = blk * block_kv + key_row < ctx
        new_state = []
        for h in range(num_kv_heads):
            q = q_ref[h, i]  # [G, D]
            k, v = tpu_rows.head_kv(kv_buf, slot, h, q.dtype, interpret=interpret_rows)
            s = common.block_scores(q, k, scale=sm_scale * scales_ref[2 * h], soft_cap=soft_cap, precision=precision)
            v = jnp.where(real, v, 0)
            new_state.append(
                common.online_softmax_update(
                    state[h], jnp.where(mask, s, common.MASK_VALUE), v, precision=precision, keepdims=True
                )
            )
        return tuple(new_state)

    def sequence(i, step):  # step: KV steps taken so far in this grid step (their slot parity)
        seq, ctx, lo, hi = blocks(i)
        pltpu.make_async_copy(new_ref.at[0, pl.ds(i, 1)], cache_out.at[pl.ds(slot_of(seq, ctx), 1)], write_sem).start()
        state = tuple(own_token(i, h, q_ref[h, i]) for h in range(num_kv_heads))

        def kv_step(blk, carry):
            step, state = carry
            slot = lax.rem(step, 2)
            copies(seq, ctx, blk, slot, "wait")

            @pl.when(blk + 1 < hi)
            def _start_next():
                copies(seq, ctx, blk + 1, 1 - slot, "start")

            @pl.when(blk + 1 == hi)
            def _start_next_sequence():
                start_first(i + 1, 1 - slot)

            return step + 1, attend(i, ctx, blk, slot, state)

        step, state = lax.fori_loop(lo, hi, kv_step, (step, state))

        @pl.when(lo >= hi)  # nothing cached: the next sequence's first step is not started yet
        def _start_next_sequence_now():
            start_first(i + 1, lax.rem(step, 2))

        for h, (_, l, acc) in enumerate(state):
            o_ref[h, i] = (acc * (scales_ref[2 * h + 1] / l)).astype(o_ref.dtype)
        return step

    start_first(0, 0)
    lax.fori_loop(0, count, sequence, 0)
    done = pltpu.make_async_copy(new_ref.at[0, pl.ds(0, 1)], cache_out.at[pl.ds(0, 1)], write_sem)
    lax.fori_loop(0, count, lambda _, c: (done.wait(), c)[1], None)


def attention(
    scalars: tuple[jax.Array, ...],
    scales: jax.Array,
    q_blocks: jax.Array,
    new_blocks: jax.Array,
    kv_cache: jax.Array,
    *,
    config: DecodeConfig,
    pages_per_seq: int,
    interpret: bool | pltpu.InterpretParams | None,
    **opts: object,
) -> tuple[jax.Array, jax.Array]:
    """scalars (kv_lens, flat page table, i32[1]: the count of decode sequences); q_blocks
    [nb, Hkv, B, G, D], new_blocks [nb, B, 2Hkv, D] -> (out blocks like q_blocks, kv_cache
    written). Rows of sequences past the count are left unwritten."""
    num_blocks, num_kv_heads, seqs, group, head_dim = q_blocks.shape
    _, page_size, two_hkv, _ = kv_cache.shape

    q_spec = pl.BlockSpec((None, num_kv_heads, seqs, group, head_dim), lambda b, *_: (b, 0, 0, 0, 0))
    # Not squeezed: Mosaic slices a DMA source out of the block's whole memref, leading 1 included.
    new_spec = pl.BlockSpec((1, seqs, two_hkv, head_dim), lambda b, *_: (b, 0, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    block_kv = config.pages_per_block * page_size
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars),
        grid=(num_blocks,),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), q_spec, new_spec, hbm],
        out_specs=[q_spec, hbm],
        scratch_shapes=[
            pltpu.VMEM((2, block_kv, two_hkv, head_dim), kv_cache.dtype),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.SemaphoreType.DMA,
        ],
    )
    kernel = functools.partial(
        _decode_kernel,
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        interpret_rows=tpu_rows.interpreted(interpret),
        **opts,
    )
    return tpu_layout.call_in_place(
        kernel,
        grid_spec,
        "ragged_paged_attention_tpu_decode",
        scalars,
        scales,
        q_blocks,
        new_blocks,
        kv_cache,
        config.vmem_limit_bytes,
        interpret,
    )
