"""The TPU kernel's query blocks, arranged by XLA around its pallas_call (tpu.py, steps 2 and 5):
q [T, Hq, D] into [nqb, Hkv, G * bq, D] blocks and back, and the sequences each block touches."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import common


def block_sequences(cu_q_lens: jax.Array, num_seqs: jax.Array, num_blocks: int, block_q: int
                    ) -> tuple[jax.Array, jax.Array]:
    """First and last sequence touching each query block ([nqb] each; last < first if none)."""
    n = common.scalar_num_seqs(num_seqs)[0]
    starts = jnp.arange(num_blocks, dtype=jnp.int32) * block_q
    ends = jnp.minimum(starts + block_q, cu_q_lens[n])
    first = jnp.searchsorted(cu_q_lens[1:], starts, side="right").astype(jnp.int32)
    last = jnp.searchsorted(cu_q_lens[1:], ends - 1, side="right").astype(jnp.int32)
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
