"""Ragged paged attention over one shard's rows of every page: a KV cache split along the sequence.

With the cache's page-row axis split over N shards (sharding/attention.py, `sequence` = N), shard
i holds rows [i * R, (i + 1) * R) of every page (R = page_size / N), that is positions
b * page_size + i * R + r of a sequence's page b. Page ids mean the same on every shard, so the
KV manager counts pages as without the split, and a page costs each device 1/N of its bytes:
the pool holds N times the tokens of one device's memory.

One call per shard, on its local cache [P, R, 2K, D] and the whole batch (every query token):
  - write: the step's new K/V whose positions fall in this shard's rows; the rest are dropped;
  - attend: each query over the keys this shard holds (this step's own tokens among them and its
    rows of the sequence's earlier pages), with the reference's online softmax, returning the
    unnormalised carry (running max, sum, weighted values).
The caller merges the N carries by their log-sum-exp (a max and two sums across the shards,
sharding/attention.py) and normalises: the same softmax as over the whole context. Pure jnp on
every platform.
"""

from __future__ import annotations

import jax

from pallas_kernels.common import SoftmaxCarry
from pallas_kernels.kv_write import write_kv
from pallas_kernels.reference import attend_carry


def attend_rows(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_cache: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    shard: jax.Array | int,
    shards: int,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> tuple[SoftmaxCarry, jax.Array]:
    """Writes this shard's rows of k/v, then every query token over the keys the shard holds.
    Returns ((m, l, acc): [T, K, G], [T, K, G], [T, K, G, D] in float32, unnormalised) and the
    cache; the shards' carries merge across the mesh (sharding/attention.merge_carries)."""
    kv_cache = write_kv(
        kv_cache, k, v, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale, rows_of=(shard, shards)
    )
    carry, _ = attend_carry(
        *(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale),
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
        rows_of=(shard, shards),
    )
    return carry, kv_cache
