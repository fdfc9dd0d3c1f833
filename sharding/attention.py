"""Ragged paged attention per shard, under `jax.shard_map` over the current mesh.

The kernel (pallas_kernels) sees one shard: query heads H/tp, KV heads K'/tp and the cache's
third axis split the same way; the batch metadata (kv_lens, page tables, cu_q_lens, num_seqs) is
replicated. Heads never interact inside attention, so the tensor split needs no collective here;
the all-reduce comes after, in the output projection.

A cache split along the sequence (mesh axis `sequence` = N > 1): the step's tokens are split in
contiguous chunks, one per shard, as the rest of the step splits them, and each page's rows are
split over the axis too (rules.kv_cache_spec), so shard i holds positions [i R, (i + 1) R) of
every page (R = page / N) and a page costs each device 1/N of its bytes: contexts up to N times
one device's pool. Each shard all-gathers the step's queries and new K/V ([T, heads, D], small
beside the cache), writes the K/V that fall in its rows, and attends every query over the keys
it holds (pallas_kernels/split_rows.py); the N partial softmaxes merge by their log-sum-exp (one
max and two sums over the axis per layer) and each shard keeps its chunk of the result. Page ids
mean the same on every shard, so the KV manager, prefix caching and preemption are unchanged.
The split path's attention is the reference's online softmax on every platform (no Pallas
kernel returns its softmax statistics yet). Gathering the queries was chosen over passing K/V
blocks round a ring: on the CPU, ring and all-gather tie (sharding/context_parallel.py measures
them on whole-cache copies), and the queries are the smaller operand once the cache is split.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sharding.mesh import SEQUENCE, TENSOR, axis_size, current_mesh

# The kernel contract: (q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs) ->
# (out, kv_cache), every argument a jax.Array.
Attend = Callable[..., tuple[jax.Array, jax.Array]]
# An online softmax's running max, sum and weighted values: [T, K, G], [T, K, G], [T, K, G, D].
SoftmaxCarry = tuple[jax.Array, jax.Array, jax.Array]
# One shard's rows of every page: (the same, shard, shards) -> ((m, l, acc), kv_cache).
AttendRows = Callable[..., tuple[SoftmaxCarry, jax.Array]]


def shard_paged_attention[C](
    attend: Callable[..., tuple[jax.Array, C]],
    attend_rows: Callable[..., tuple[SoftmaxCarry, C]],
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_cache: C,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
) -> tuple[jax.Array, C]:
    """attend(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs) -> (out, cache) is
    the kernel contract (Attend); attend_rows(the same, shard, shards) -> ((m, l, acc), cache)
    attends over one shard's rows of every page (pallas_kernels/split_rows.py: AttendRows).
    Without a mesh this is `attend` itself. The cache `C`: the contract's array, or a pytree of
    arrays split alike (a quantized cache's pages and scales, the scales' one row whole)."""
    args = (q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs)
    mesh = current_mesh()
    if mesh is None:
        return attend(*args)
    shards = axis_size(mesh, SEQUENCE)
    heads = TENSOR if axis_size(mesh, TENSOR) > 1 else None
    tok = P(SEQUENCE if shards > 1 else None, heads, None)  # q, k, v [T, heads, D]
    rows = SEQUENCE if shards > 1 else None
    cache = jax.tree.map(lambda x: P(None, rows if x.shape[1] > 1 else None, heads, None), kv_cache)

    def per_shard(
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        kv_cache: C,
        kv_lens: jax.Array,
        page_indices: jax.Array,
        cu_q_lens: jax.Array,
        num_seqs: jax.Array,
    ) -> tuple[jax.Array, C]:
        if shards == 1:
            return attend(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs)
        # Every shard: all the step's queries and K/V, its rows of every page; the partial
        # softmaxes merge across the axis, and each shard keeps its own chunk of the result.
        q_all, k_all, v_all = (jax.lax.all_gather(x, SEQUENCE, axis=0, tiled=True) for x in (q, k, v))
        shard = jax.lax.axis_index(SEQUENCE)
        carry, kv_cache = attend_rows(
            q_all, k_all, v_all, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, shard, shards
        )
        out = merge_carries(carry, SEQUENCE).reshape(q_all.shape).astype(q.dtype)  # [T, H, D]
        return jax.lax.dynamic_slice_in_dim(out, shard * q.shape[0], q.shape[0]), kv_cache

    return jax.shard_map(
        per_shard, in_specs=(tok, tok, tok, cache, P(), P(), P(), P()), out_specs=(tok, cache), check_vma=False
    )(*args)


def merge_carries(carry: SoftmaxCarry, axis: str) -> jax.Array:
    """The shards' carries merged across mesh axis `axis` by their log-sum-exp and normalised:
    out [T, K, G, D] float32 (rows with no key at all: zeros)."""
    m, l, acc = carry
    m_all = jax.lax.pmax(m, axis)
    weight = jnp.where(jnp.isfinite(m), jnp.exp(m - jnp.where(jnp.isfinite(m_all), m_all, 0.0)), 0.0)
    l = jax.lax.psum(l * weight, axis)
    acc = jax.lax.psum(acc * weight[..., None], axis)
    return acc / jnp.where(l > 0, l, 1.0)[..., None]
