"""Ragged paged attention per shard, under `jax.shard_map` over the current mesh.

The kernel (pallas_kernels) sees one shard: query heads H/tp, KV heads K'/tp and the cache's
third axis split the same way; the batch metadata (kv_lens, page tables, cu_q_lens, num_seqs) is
replicated. Heads never interact inside attention, so the tensor split needs no collective here;
the all-reduce comes after, in the output projection.

Context parallelism (mesh axis `sequence` > 1): the step's tokens are split in contiguous
chunks, one per shard, and every shard keeps a whole copy of the cache (split by heads only).
Each shard all-gathers this step's new K/V, writes all of them into its copy, and attends with
its own query chunk. The chunk's metadata is rewritten so the kernel sees a ragged batch of the
chunk's tokens at their true positions (`local_metadata`). All-gather of K/V was measured
against ring attention (ppermute of K/V blocks) and kept; see sharding/context_parallel.py.
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
# Writes new K/V only: (kv_cache, k, v, kv_lens, page_indices, cu_q_lens, num_seqs) -> kv_cache.
WriteKv = Callable[..., jax.Array]


def local_metadata(
    kv_lens: jax.Array, cu_q_lens: jax.Array, offset: jax.Array | int, num_local: int
) -> tuple[jax.Array, jax.Array]:
    """Metadata of the query tokens [offset, offset + num_local) of a ragged batch.

    Sequence s keeps the rows of its tokens that fall in the chunk; its kv_len becomes the
    position after the chunk's last token of s, so the kernel's position rule
    (kv_len - q_len + j) still gives each token its true position. Sequences with no token in
    the chunk get kv_len 0 (they read nothing).
    """
    lo = jnp.clip(cu_q_lens[:-1] - offset, 0, num_local)  # [S]
    hi = jnp.clip(cu_q_lens[1:] - offset, 0, num_local)  # [S]
    cu_local = jnp.concatenate([jnp.zeros((1,), cu_q_lens.dtype), hi])  # [S+1]
    dropped_after = cu_q_lens[1:] - offset - hi  # tokens of s that lie after the chunk
    kv_local = jnp.where(hi > lo, kv_lens - dropped_after, 0).astype(kv_lens.dtype)
    return kv_local, cu_local.astype(cu_q_lens.dtype)


def shard_paged_attention[C](
    attend: Callable[..., tuple[jax.Array, C]],
    write_kv: Callable[..., C],
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
    the kernel contract (Attend); write_kv(kv_cache, k, v, kv_lens, page_indices, cu_q_lens,
    num_seqs) writes new K/V only (WriteKv). Without a mesh this is `attend` itself. The cache `C`:
    the contract's array, or a pytree of arrays split alike (a quantized cache's pages and scales)."""
    args = (q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs)
    mesh = current_mesh()
    if mesh is None:
        return attend(*args)
    split_seq = axis_size(mesh, SEQUENCE) > 1
    heads = TENSOR if axis_size(mesh, TENSOR) > 1 else None
    tok = P(SEQUENCE if split_seq else None, heads, None)  # q, k, v [T, heads, D]
    cache = P(None, None, heads, None)

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
        if split_seq:
            k_all = jax.lax.all_gather(k, SEQUENCE, axis=0, tiled=True)  # [T, K'/tp, D]
            v_all = jax.lax.all_gather(v, SEQUENCE, axis=0, tiled=True)
            kv_cache = write_kv(kv_cache, k_all, v_all, kv_lens, page_indices, cu_q_lens, num_seqs)
            offset = jax.lax.axis_index(SEQUENCE) * q.shape[0]
            kv_lens, cu_q_lens = local_metadata(kv_lens, cu_q_lens, offset, q.shape[0])
        # The kernel rewrites this chunk's K/V into the slots just written: same values.
        return attend(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs)

    return jax.shard_map(
        per_shard, in_specs=(tok, tok, tok, cache, P(), P(), P(), P()), out_specs=(tok, cache), check_vma=False
    )(*args)
