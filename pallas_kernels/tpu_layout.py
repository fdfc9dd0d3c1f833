"""The TPU kernels' operands, arranged by XLA around their pallas_calls: the ragged kernel's
query blocks (q [T, Hq, D] into [nqb, Hkv, G * bq, D] blocks and back) and the sequences each
block touches (tpu_ragged.py, steps 2 and 5); the batch's sequences ordered by path (tpu.py)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import common


def block_sequences(
    cu_q_lens: jax.Array, num_seqs: jax.Array, bounds: jax.Array, num_blocks: int, block_q: int
) -> tuple[jax.Array, jax.Array]:
    """First and last sequence touching each query block of the tokens [bounds[0], bounds[1])
    ([nqb] each; last < first if none)."""
    n = common.scalar_num_seqs(num_seqs)[0]
    starts = bounds[0] + jnp.arange(num_blocks, dtype=jnp.int32) * block_q
    ends = jnp.minimum(starts + block_q, bounds[1])
    first = common.bucket_of(cu_q_lens[1:], starts)
    last = common.bucket_of(cu_q_lens[1:], ends - 1)
    last = jnp.where(ends > starts, jnp.minimum(last, n - 1), -1)
    return jnp.minimum(first, jnp.maximum(n - 1, 0)), last


def q_blocks(q: jax.Array, num_kv_heads: int, block_q: int) -> jax.Array:
    """q [T, Hq, D] -> [nqb, Hkv, G * bq, D], T padded to nqb * bq; row g * bq + i of a block's
    head h is token i of the block, query head g of kv head h's group."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    num_blocks = pl.cdiv(num_tokens, block_q)
    q_blocks = jnp.pad(q, ((0, num_blocks * block_q - num_tokens), (0, 0), (0, 0)))
    q_blocks = q_blocks.reshape(num_blocks, block_q, num_kv_heads, group, head_dim)
    return q_blocks.transpose(0, 2, 3, 1, 4).reshape(num_blocks, num_kv_heads, group * block_q, head_dim)


def token_rows(out_blocks: jax.Array, num_tokens: int, group: int) -> jax.Array:
    """The inverse of `q_blocks`: [nqb, Hkv, G * bq, D] -> [T, Hq, D]."""
    num_blocks, num_kv_heads, rows_m, head_dim = out_blocks.shape
    bq = rows_m // group
    out = out_blocks.reshape(num_blocks, num_kv_heads, group, bq, head_dim)
    out = out.transpose(0, 3, 1, 2, 4).reshape(num_blocks * bq, num_kv_heads * group, head_dim)
    return out[:num_tokens]


PATH_DECODE, PATH_MIXED, PATH_PREFILL, PATH_NONE = range(4)


def path_order(cu_q_lens: jax.Array, num_seqs: jax.Array, prefill_from: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The sequences ordered by path (decode: one query token; mixed: 2 .. prefill_from - 1;
    prefill: more; then those without tokens), stable within a path.

    -> (order i32[S]: the original index of each ordered sequence, cu_q_lens of the ordered
    batch i32[S + 1], the sequence count of each path i32[3])."""
    q_lens = common.real_q_lens(cu_q_lens, num_seqs)
    path = jnp.where(
        q_lens == 1,
        PATH_DECODE,
        jnp.where(q_lens >= prefill_from, PATH_PREFILL, jnp.where(q_lens > 1, PATH_MIXED, PATH_NONE)),
    )
    order = jnp.argsort(path, stable=True).astype(jnp.int32)
    cu_ordered = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_lens[order], dtype=jnp.int32)])
    counts = jnp.stack([jnp.sum(path == p, dtype=jnp.int32) for p in (PATH_DECODE, PATH_MIXED, PATH_PREFILL)])
    return order, cu_ordered, counts


def token_maps(
    cu_q_lens: jax.Array, cu_ordered: jax.Array, order: jax.Array, num_tokens: int
) -> tuple[jax.Array, jax.Array]:
    """(source i32[T]: the original token of each token of the ordered batch, dest i32[T]: the
    ordered index of each original token); tokens past the real ones map to themselves."""
    num_seqs_max = order.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    real = t < cu_ordered[num_seqs_max]

    def seq_of(cu):
        return jnp.clip(common.bucket_of(cu[1:], t), 0, num_seqs_max - 1)

    ordered_seq, seq = seq_of(cu_ordered), seq_of(cu_q_lens)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(num_seqs_max, dtype=jnp.int32))
    source = jnp.where(real, cu_q_lens[order[ordered_seq]] + t - cu_ordered[ordered_seq], t)
    dest = jnp.where(real, cu_ordered[rank[seq]] + t - cu_q_lens[seq], t)
    return source, dest


def call_in_place(
    kernel: Callable[..., None],
    grid_spec: pltpu.PrefetchScalarGridSpec,
    name: str,
    scalars: tuple[jax.Array, ...],
    scales: jax.Array,
    q_blocks: jax.Array,
    new_rows: jax.Array,
    kv_cache: jax.Array,
    vmem_limit_bytes: int | None,
    interpret: bool | pltpu.InterpretParams | None,
) -> tuple[jax.Array, jax.Array]:
    """kernel(*scalars, scales, q_blocks, new_rows, cache viewed as [P * page, 2Hkv, D]) over a
    parallel grid -> (out blocks like q_blocks, the cache written in place: an input/output
    alias)."""
    num_pages, page_size, two_hkv, head_dim = kv_cache.shape
    flat_cache = kv_cache.reshape(num_pages * page_size, two_hkv, head_dim)
    out_blocks, flat_cache = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        name=name,
        out_shape=[
            jax.ShapeDtypeStruct(q_blocks.shape, q_blocks.dtype),
            jax.ShapeDtypeStruct(flat_cache.shape, flat_cache.dtype),
        ],
        input_output_aliases={len(scalars) + 3: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=vmem_limit_bytes),
        interpret=interpret or False,
    )(*scalars, scales, q_blocks, new_rows, flat_cache)
    return out_blocks, flat_cache.reshape(kv_cache.shape)
