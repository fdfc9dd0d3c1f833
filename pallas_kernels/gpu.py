"""Ragged paged attention for GPUs: a Pallas kernel on the Triton lowering.

One call, as the contract in docs/design/architecture.md: write this step's K/V into the cache and attend.

1. Inputs as the step has them (`_inputs`): q viewed as [T * Hq, D] rows, and this step's K and
   V as the cache stores them ([T, Hkv, D] each: k and v themselves for a cache of their dtype,
   else cast or quantized with the per-head scales by one XLA fusion). No gather or transpose
   around it.
2. Work list (XLA, O(S + T/bq) integers): the ragged batch is cut into work items, each a block
   of at most `block_q` query tokens of ONE sequence (`meta[w]`: row count, first position,
   page-table offset, cached context length, token offset). There are at most cdiv(T, bq) + S
   items, a static bound, so the grid is static; the items left idle zero the padding tokens.
3. Kernel grid (W, Hkv, C): work item x kv head x KV split (the kernel: gpu_kernel.py). A
   program attends its item's query rows of kv head h over its share of the KV blocks: cached
   positions gathered from the cache through the flattened page table, this step's from the K/V
   inputs.
4. KV write, fused: the split-0 program of each (item, head) stores its rows' K and V into their
   slots of the cache, an input/output alias (in place under donation). For a head_dim that is
   not a power of two XLA writes the K/V first (`_inputs`) and the kernel only reads.
5. Output: each program stores its rows straight into out [T * Hq, D]. Split-K (flash-decoding,
   C > 1 programs share one item's KV blocks) stores unnormalised (acc, m, l) in the same rows,
   and one XLA fusion merges them.
6. The decode split (`_decode_split`), chosen at run time (`GpuPaths`, the default for a
   prefill-like batch): the sequences with one query token get an item each in a call with the
   decode blocks, and the others theirs in a call with the prefill blocks, over the first call's
   output buffer; nothing recompiles when the mix changes.

Supports bf16/f16/f32 q, an unquantized cache of q's dtype or an int8/fp8 cache with per-kv-head
scales, head_dim a multiple of 8 up to 256 (padded to a power of two inside the kernel, the
padding masked), page_size a power of two, sliding window, soft cap. The shape limits, block
sizes and split count live in gpu_config.py.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common, gpu_kernel
from pallas_kernels.gpu_config import (
    GpuConfig,
    GpuPaths,
    check_config,
    default_paths,
    padded_head_dim,
    unsupported_reason,
)
from pallas_kernels.gpu_work import combine, new_kv, work_list
from pallas_kernels.kv_write import write_kv

# _attend's operands: q rows, this step's K and V, kv_cache, the scales, kv_lens, page_indices,
# cu_q_lens, num_seqs (`_inputs`).
type Operands = tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]


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
    **opts: Any,
) -> tuple[jax.Array | tuple[jax.Array, ...], jax.Array]:
    """The pallas_call over grid (W, Hkv, C) -> (out rows [T * Hq, D], or the C partial (acc, m,
    l) in that row layout; kv_cache written). `prev` (a call before over the same batch) is the
    output's buffer of a call without splits, its other rows kept."""
    num_kv_heads = k_new.shape[1]
    num_pages, page_size, two_hkv, real_head_dim = kv_cache.shape
    splits = config.num_splits
    # A cache row narrower than head_dim (not a power of two): the BlockSpec's last dim
    # overhangs the array and the lowering masks its loads to the real columns. The kernel then
    # only reads the cache; the caller writes this step's K/V with XLA (compiled on an H100, the
    # fused write of an overhanging block corrupted neighbouring slots).
    fused_write = real_head_dim == q_rows.shape[1]  # q's head_dim: padded to a power of two
    has_prev = prev is not None and splits == 1
    kernel = functools.partial(
        gpu_kernel.attention_kernel,
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
    operands = [meta, flat_pages, scales, q_rows, k_new, v_new, flat_cache]
    call = gpu_kernel.call_specs(operands, prev if has_prev else None, splits, fused_write)
    result = pl.pallas_call(
        kernel,
        grid=(meta.shape[0], num_kv_heads, splits),
        in_specs=call.in_specs,
        out_specs=call.out_specs,
        out_shape=call.out_shape,
        input_output_aliases=call.aliases,
        interpret=interpret,
        name="ragged_paged_attention_gpu",
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
    )(*call.operands)
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
    **opts: Any,
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
    if isinstance(out, tuple):  # the splits' partials: one XLA fusion merges them in the row layout
        rows = lambda x: jnp.repeat(x, q_rows.shape[0] // num_tokens)[:, None]  # noqa: E731
        other = 0 if prev is None else jnp.where(rows(real), prev, 0)
        out = jnp.where(rows(mine), combine(*out).astype(q_rows.dtype), other)
    return out, kv_cache


def _decode_split(operands: Operands, paths: GpuPaths, **opts: Any) -> tuple[jax.Array, jax.Array]:
    """The sequences with one query token by a call with `paths.decode` (an item each), then the
    others by a call with `paths.rest` over the first call's output buffer."""
    _, k_new, *_, page_indices, cu_q_lens, num_seqs = operands
    num_tokens, num_seqs_max = k_new.shape[0], page_indices.shape[0]
    decode = common.real_q_lens(cu_q_lens, num_seqs) == 1
    out, kv_cache = _attend(
        *operands, None, config=paths.decode, select=decode, num_items=min(num_tokens, num_seqs_max), **opts
    )
    return _attend(
        *operands[:3], kv_cache, *operands[4:], out, config=paths.rest, select=~decode, num_items=None, **opts
    )


def _checked_config(
    config: GpuConfig | GpuPaths | None, q: jax.Array, kv_cache: jax.Array, page_indices: jax.Array
) -> GpuConfig | GpuPaths:
    """`config`, or `default_paths`' for these shapes; raises UnsupportedShape unless it tiles."""
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = kv_cache.shape[1], kv_cache.shape[2] // 2
    group = num_q_heads // num_kv_heads
    num_seqs_max, pages_per_seq = page_indices.shape
    if config is None:
        config = default_paths(
            num_tokens, num_seqs_max, group, num_kv_heads, head_dim, page_size, pages_per_seq, q.dtype
        )
    check_config(config, common.next_pow2(group))
    return config


def _inputs(
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
) -> Operands:
    """`_attend`'s operands: q rows [T * Hq, Dp] and this step's K and V [T, Hkv, Dp] as the
    cache stores them (head_dim padded to Dp, a power of two), kv_cache (this step's K/V written
    by XLA where Dp != D), the scales [Hkv, 2], kv_lens, page_indices, cu_q_lens, num_seqs."""
    num_tokens, num_q_heads, head_dim = q.shape
    dp = padded_head_dim(head_dim)
    if dp != head_dim:  # the kernel cannot write an overhanging block: XLA writes, in place
        kv_cache = write_kv(kv_cache, k, v, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale)
    k_new, v_new = new_kv(k, v, kv_cache.dtype, dp, k_scale, v_scale)
    q_rows = jnp.pad(q.reshape(num_tokens * num_q_heads, head_dim), ((0, 0), (0, dp - head_dim)))
    scales = common.kv_scales(kv_cache, k_scale, v_scale)
    return q_rows, k_new, v_new, kv_cache, scales, kv_lens, page_indices, cu_q_lens, num_seqs


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
    config = _checked_config(config, q, kv_cache, page_indices)
    num_tokens, num_q_heads, head_dim = q.shape
    operands = _inputs(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale)
    opts: dict[str, Any] = dict(
        group=num_q_heads // (kv_cache.shape[2] // 2),
        interpret=interpret,
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None,
    )
    if isinstance(config, GpuConfig):
        out, kv_cache = _attend(*operands, None, config=config, **opts)
    else:  # the run-time split: each call writes and reads only its own sequences' slots
        out, kv_cache = _decode_split(operands, config, **opts)
    return out[:, :head_dim].reshape(num_tokens, num_q_heads, head_dim), kv_cache
