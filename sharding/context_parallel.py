"""Causal attention over one sequence split across the `sequence` axis: ring vs all-gather.

Each of n shards holds a contiguous chunk of Tl = T / n query tokens and their K/V. Shard i needs
K/V of chunks 0..i. Two ways to get them, both computing chunk-by-chunk with an online softmax
and skipping chunks that lie wholly in the future (so they do the same arithmetic):

  all-gather: one `all_gather` of K/V up front, then attend over chunks 0..i of the result;
  ring:       n - 1 `ppermute` steps pass K/V chunks around the ring; at step s shard i holds
              chunk (i - s) mod n and attends to it when that chunk is not in its future.

Measured with `benchmarks/bench_sharding.py context` (8 forced CPU devices on 2 cores, n = 4,
float32, H = 8, K = 2, D = 64; numbers in benchmarks/RESULTS.md): a tie within 0.5%, all-gather
ahead at every length (1024: 38.9 vs 39.0 ms, 4096: 1834 vs 1844 ms). On the CPU a collective is
a memory copy and ring's n - 1 dependent ppermutes only add synchronisation; the overlap of
transfer and compute that makes ring attention pay off on TPU ICI links does not exist. The
engine therefore all-gathers this step's new K/V (sharding/attention.py), which also lets it
reuse the paged kernel unchanged (ring would need a kernel that returns its softmax statistics);
ring is kept here as the measured alternative and for its test.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from sharding.mesh import SEQUENCE

# Online softmax over a chunk of queries: running max, sum [K, G, Tq]; acc [K, G, Tq, D].
_Carry = tuple[jax.Array, jax.Array, jax.Array]


def _chunk_update(
    carry: _Carry, q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array, scale: float
) -> _Carry:
    """One K/V chunk of an online softmax. q [Tq, K, G, D]; k, v [Tk, K, D]."""
    m, l, acc = carry  # [K, G, Tq], [K, G, Tq], [K, G, Tq, D]
    s = jnp.einsum("qkgd,tkd->kgqt", q, k) * scale  # [K, G, Tq, Tk]
    s = jnp.where(k_pos[None, None, None, :] <= q_pos[None, None, :, None], s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    alpha = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
    return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + jnp.einsum("kgqt,tkd->kgqd", p, v)


def _init(q: jax.Array) -> _Carry:
    tq, kh, g, d = q.shape
    return (
        jnp.full((kh, g, tq), -jnp.inf, jnp.float32),
        jnp.zeros((kh, g, tq), jnp.float32),
        jnp.zeros((kh, g, tq, d), jnp.float32),
    )


def _finish(carry: _Carry, shape: tuple[int, ...]) -> jax.Array:
    _, l, acc = carry
    out = acc / l[..., None]  # [K, G, Tq, D]
    return jnp.transpose(out, (2, 0, 1, 3)).reshape(shape)


def _per_shard(method: str, axis: str, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """q [Tl, H, D], k/v [Tl, K, D] of this shard's chunk -> out [Tl, H, D]."""
    tl, h, d = q.shape
    kh = k.shape[1]
    n = jax.lax.axis_size(axis)
    i = jax.lax.axis_index(axis)
    qg = q.astype(jnp.float32).reshape(tl, kh, h // kh, d)
    q_pos = i * tl + jnp.arange(tl)
    scale = d**-0.5
    carry = _init(qg)
    if method == "allgather":
        k_all = jax.lax.all_gather(k, axis, axis=0, tiled=True)  # [T, K, D]
        v_all = jax.lax.all_gather(v, axis, axis=0, tiled=True)
    src: int | jax.Array  # the shard whose K/V chunk this step reads
    for step in range(n):
        if method == "allgather":
            src = step
            kc, vc = k_all[step * tl : (step + 1) * tl], v_all[step * tl : (step + 1) * tl]
        else:
            src = (i - step) % n
            kc, vc = k, v
        k_pos = src * tl + jnp.arange(tl)
        update = functools.partial(
            _chunk_update,
            q=qg,
            k=kc.astype(jnp.float32),
            v=vc.astype(jnp.float32),
            q_pos=q_pos,
            k_pos=k_pos,
            scale=scale,
        )
        carry = jax.lax.cond(src <= i, update, lambda c: c, carry)
        if method == "ring" and step < n - 1:
            perm = [(j, (j + 1) % n) for j in range(n)]
            k, v = jax.lax.ppermute(k, axis, perm), jax.lax.ppermute(v, axis, perm)
    return _finish(carry, q.shape).astype(q.dtype)


def context_parallel_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mesh: Mesh, method: str = "allgather", axis: str = SEQUENCE
) -> jax.Array:
    """Causal attention of one sequence, q [T, H, D], k/v [T, K, D], split over `axis`."""
    if method not in ("allgather", "ring"):
        raise ValueError(f"method must be 'allgather' or 'ring', got {method!r}")
    spec = P(axis, None, None)
    return jax.shard_map(
        functools.partial(_per_shard, method, axis),
        mesh=mesh,
        in_specs=(spec, spec, spec),
        out_specs=spec,
        check_vma=False,
    )(q, k, v)


def dense_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """The unsplit oracle: q [T, H, D], k/v [T, K, D] -> [T, H, D]."""
    t, h, d = q.shape
    kh = k.shape[1]
    qg = q.astype(jnp.float32).reshape(t, kh, h // kh, d)
    pos = jnp.arange(t)
    carry = _chunk_update(_init(qg), qg, k.astype(jnp.float32), v.astype(jnp.float32), pos, pos, d**-0.5)
    return _finish(carry, q.shape).astype(q.dtype)
