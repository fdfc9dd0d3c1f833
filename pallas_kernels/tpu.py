"""Ragged paged attention for TPUs: static decode, mixed and prefill paths of Pallas kernels.

One call, as the contract in docs/design/architecture.md: write this step's K/V into the cache and attend.
Like RPA v3's decode / prefill / mixed split, the batch's sequences take one of three paths,
chosen at run time from cu_q_lens (nothing recompiles when the mix changes):

- decode, one query token: tpu_decode.py, several sequences per grid step, a [G, D] query
  operand per kv head, no causal mask, KV steps of up to 2048 positions;
- prefill, at least `paths.prefill.block_q` query tokens: tpu_ragged.py with query blocks of
  about 256 rows, so its matmuls fill the MXU;
- mixed, 2 .. prefill.block_q - 1 tokens (speculative verification, short chunks):
  tpu_ragged.py with 16-token query blocks, so a block spans few sequences.

Layout (XLA): the sequences are ordered by path (`tpu_layout.path_order`, stable within a
path), so each path's tokens are one contiguous range of the ordered batch; each path gathers
its queries and this step's stored K/V rows from the original token order. The three
pallas_calls run in turn over the one cache (each an input/output alias that writes only its
own sequences' slots). Each grid is static, sized for the most tokens its path can hold; the
steps past a path's real blocks do no work but move their q and out blocks (a parallel grid
visits each block once: a spare block shared by the idle steps would be revisited). The outputs
are gathered back into token order; padding tokens get zeros.

A `TpuConfig` instead of paths runs the ragged kernel once over the whole batch. The default
blocks come from tpu_blocks.py, fitted to the target chip's VMEM.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import common, tpu_decode, tpu_layout, tpu_ragged
from pallas_kernels.kv_write import stored_kv
from pallas_kernels.tpu_blocks import default_paths
from pallas_kernels.tpu_config import DecodeConfig, TpuConfig, TpuPaths, check_config, unsupported_reason


@dataclasses.dataclass(frozen=True)
class _Batch:
    """The call's operands as the kernels take them, with the sequences in one order (their
    own, or ordered by path)."""

    q: jax.Array  # [T, Hq, D], original token order
    source: jax.Array  # i32[T]: the original token of each token in this order
    stored: jax.Array  # [T, 2Hkv, D]: this step's K/V as the cache holds them, in this order
    kv_cache: jax.Array  # [P, page, 2Hkv, D]
    kv_lens: jax.Array  # i32[S], in this order
    pages: jax.Array  # i32[S * pages_per_seq]: the flattened page table, in this order
    cu_q_lens: jax.Array  # i32[S + 1], in this order
    num_seqs: jax.Array  # the real sequence count
    scales: jax.Array  # f32[2 * Hkv]: each kv head's K and V scale

    @property
    def num_kv_heads(self) -> int:
        return self.kv_cache.shape[2] // 2


def _rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[index] along the token axis; index == len(x) reads a zero row."""
    return jnp.concatenate([x, jnp.zeros((1, *x.shape[1:]), x.dtype)])[index]


def _decode_path(batch: _Batch, config: DecodeConfig, count: jax.Array, **opts: Any) -> tuple[jax.Array, jax.Array]:
    """The decode sequences (the batch's first `count`, one token each) -> (out rows
    [nb * B, Hq, D] in the batch's token order, kv_cache)."""
    num_tokens, num_q_heads, head_dim = batch.q.shape
    seqs, num_kv_heads = config.seqs_per_block, batch.num_kv_heads
    num_blocks = pl.cdiv(min(num_tokens, batch.kv_lens.shape[0]), seqs)
    j = jnp.arange(num_blocks * seqs, dtype=jnp.int32)
    real = j < count
    take = jnp.where(real, batch.source[jnp.minimum(j, num_tokens - 1)], num_tokens)
    q_blocks = _rows(batch.q, take).reshape(num_blocks, seqs, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    new_blocks = _rows(batch.stored, jnp.where(real, j, num_tokens)).reshape(
        num_blocks, seqs, 2 * num_kv_heads, head_dim
    )
    scalars = (batch.kv_lens, batch.pages, count.reshape(1))
    out, kv_cache = tpu_decode.attention(
        scalars, batch.scales, q_blocks.transpose(0, 2, 1, 3, 4), new_blocks, batch.kv_cache, config=config, **opts
    )
    return out.transpose(0, 2, 1, 3, 4).reshape(num_blocks * seqs, num_q_heads, head_dim), kv_cache


def _ragged_path(
    batch: _Batch, config: TpuConfig, start: jax.Array, end: jax.Array, max_tokens: int, **opts: Any
) -> tuple[jax.Array, jax.Array]:
    """The batch's tokens [start, end) by the ragged kernel -> (out rows [nqb * bq, Hq, D] for
    tokens start.., kv_cache)."""
    bq = config.block_q
    num_tokens, num_q_heads, _ = batch.q.shape
    num_blocks = pl.cdiv(max(max_tokens, 1), bq)
    j = start + jnp.arange(num_blocks * bq, dtype=jnp.int32)
    take = jnp.where(j < end, batch.source[jnp.minimum(j, num_tokens - 1)], num_tokens)
    q_blocks = tpu_layout.q_blocks(_rows(batch.q, take), batch.num_kv_heads, bq)
    bounds = jnp.stack([start, end])
    first_seq, last_seq = tpu_layout.block_sequences(batch.cu_q_lens, batch.num_seqs, bounds, num_blocks, bq)
    scalars = (batch.kv_lens, batch.pages, batch.cu_q_lens, bounds, first_seq, last_seq)
    # Stored rows with a page of padding at each end: a page-sized chunk of this step's keys
    # may start up to a page before a sequence's first token or end a page after its last.
    page_size = batch.kv_cache.shape[1]
    new_rows = jnp.pad(batch.stored, ((page_size, page_size), (0, 0), (0, 0)))
    out, kv_cache = tpu_ragged.attention(
        scalars, batch.scales, q_blocks, new_rows, batch.kv_cache, config=config, **opts
    )
    return tpu_layout.token_rows(out, num_blocks * bq, num_q_heads // batch.num_kv_heads), kv_cache


def _one_call(batch: _Batch, config: TpuConfig, **opts: Any) -> tuple[jax.Array, jax.Array]:
    """The whole batch in its own order by one ragged kernel."""
    num_tokens = batch.q.shape[0]
    end = batch.cu_q_lens[common.scalar_num_seqs(batch.num_seqs)[0]]
    out, kv_cache = _ragged_path(batch, config, jnp.int32(0), end, num_tokens, **opts)
    return out[:num_tokens], kv_cache


def _three_paths(batch: _Batch, paths: TpuPaths, **opts: Any) -> tuple[jax.Array, jax.Array]:
    """Decode, mixed and prefill sequences each by their kernel, over the batch ordered by path."""
    num_tokens = batch.q.shape[0]
    num_seqs_max = batch.kv_lens.shape[0]
    prefill_from = paths.prefill.block_q
    order, cu_ordered, counts = tpu_layout.path_order(batch.cu_q_lens, batch.num_seqs, prefill_from)
    source, dest = tpu_layout.token_maps(batch.cu_q_lens, cu_ordered, order, num_tokens)
    ordered = dataclasses.replace(
        batch,
        source=source,
        stored=batch.stored[source],
        kv_lens=batch.kv_lens[order],
        pages=batch.pages.reshape(num_seqs_max, -1)[order].reshape(-1),
        cu_q_lens=cu_ordered,
        num_seqs=jnp.sum(counts),
    )
    decode_end = counts[0]
    mixed_end, prefill_end = cu_ordered[counts[0] + counts[1]], cu_ordered[jnp.sum(counts)]
    out_d, kv_cache = _decode_path(ordered, paths.decode, decode_end, **opts)
    mixed_max = min(num_tokens, (prefill_from - 1) * num_seqs_max)
    out_m, kv_cache = _ragged_path(
        dataclasses.replace(ordered, kv_cache=kv_cache), paths.mixed, decode_end, mixed_end, mixed_max, **opts
    )
    out_p, kv_cache = _ragged_path(
        dataclasses.replace(ordered, kv_cache=kv_cache), paths.prefill, mixed_end, prefill_end, num_tokens, **opts
    )
    # Each original token's row: from its path's output, or the zero row past the real tokens.
    size_d, size_m = out_d.shape[0], out_m.shape[0]
    index = jnp.where(
        dest < decode_end,
        dest,
        jnp.where(
            dest < mixed_end,
            size_d + dest - decode_end,
            jnp.where(dest < prefill_end, size_d + size_m + dest - mixed_end, size_d + size_m + out_p.shape[0]),
        ),
    )
    return _rows(jnp.concatenate([out_d, out_m, out_p]), index), kv_cache


def _checked_config(
    config: TpuPaths | TpuConfig | None, q: jax.Array, kv_cache: jax.Array, page_indices: jax.Array
) -> TpuPaths | TpuConfig:
    """`config`, or `default_paths`' for these shapes; raises UnsupportedShape unless it tiles."""
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = kv_cache.shape[1], kv_cache.shape[2] // 2
    num_seqs_max, pages_per_seq = page_indices.shape
    if config is None:
        config = default_paths(
            num_tokens,
            num_seqs_max,
            num_q_heads // num_kv_heads,
            num_kv_heads,
            page_size,
            pages_per_seq,
            head_dim,
            q.dtype,
            kv_cache.dtype,
        )
    check_config(config)
    return config


def _batch(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_cache: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    k_scale: jax.Array | None,
    v_scale: jax.Array | None,
) -> _Batch:
    """The call's operands as the kernels take them, in the batch's own order."""
    return _Batch(
        q=q,
        source=jnp.arange(q.shape[0], dtype=jnp.int32),
        stored=stored_kv(k, v, kv_cache.dtype, k_scale, v_scale),
        kv_cache=kv_cache,
        kv_lens=kv_lens.astype(jnp.int32),
        pages=page_indices.reshape(-1).astype(jnp.int32),
        cu_q_lens=cu_q_lens.astype(jnp.int32),
        num_seqs=common.scalar_num_seqs(num_seqs),
        scales=common.kv_scales(kv_cache, k_scale, v_scale).reshape(-1),
    )


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "config", "interpret"))
def ragged_paged_attention_tpu(
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
    config: TpuPaths | TpuConfig | None = None,
    interpret: bool | pltpu.InterpretParams | None = None,
) -> tuple[jax.Array, jax.Array]:
    """q [T, Hq, D]; k, v [T, Hkv, D]; kv_cache [P, page, 2*Hkv, D] -> (out [T, Hq, D], kv_cache).

    `config`: the paths' blocks (default: `default_paths` of these shapes), or one TpuConfig
    for a single ragged call. `interpret`: None/False compiles for the TPU; a
    `pltpu.InterpretParams` runs the TPU interpreter (so does an enclosing
    `pltpu.force_tpu_interpret_mode`)."""
    common.validate_kernel_call(
        "pallas_tpu",
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
    config = _checked_config(config, q, kv_cache, page_indices)
    batch = _batch(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale)
    opts = dict(
        pages_per_seq=page_indices.shape[1],
        interpret=interpret,
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None,
    )
    if isinstance(config, TpuConfig):
        return _one_call(batch, config, **opts)
    return _three_paths(batch, config, **opts)
