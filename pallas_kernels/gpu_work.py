"""The GPU kernel's work list and query blocks (XLA around the pallas_call of gpu.py).

`work_list` cuts the ragged batch into work items of at most block_q query tokens of one
sequence (step 2 of gpu.py's docstring); `q_blocks` gathers each item's queries into the
[bq * Gp, D] rows a program loads; `combine` merges the partial softmaxes of a split-K call.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.reference import token_positions

META_WIDTH = 8  # rows, pos0, table offset, ctx_len, token offset, 3 x unused (power of two)


def work_list(cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array, num_tokens: int,
               block_q: int, pages_per_seq: int, *, select: jax.Array | None = None,
               num_items: int | None = None) -> tuple[jax.Array, ...]:
    """Per work item: meta [W, 8] = (rows, first row's position, page-table offset, cached
    context length, token index minus position, 0, 0, 0); per token t: (item, row, is-real).

    `select` (bool [S]) keeps only those sequences' tokens: the others get no items and their
    tokens read as not real. `num_items` (static) bounds the items where the caller knows a
    tighter bound than a block per block_q tokens plus a partial one per sequence (one item per
    selected decode sequence)."""
    num_seqs_max = kv_lens.shape[0]
    q_lens = common.real_q_lens(cu_q_lens, num_seqs)  # [S]
    taken = q_lens if select is None else jnp.where(select, q_lens, 0)
    blocks = (taken + block_q - 1) // block_q
    cu_blocks = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(blocks, dtype=jnp.int32)])
    num_items = num_items or pl.cdiv(num_tokens, block_q) + num_seqs_max
    w = jnp.arange(num_items, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_blocks[1:], w, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, num_seqs_max - 1)
    live = w < cu_blocks[num_seqs_max]
    first = (w - cu_blocks[seq]) * block_q  # offset of row 0 inside its sequence
    rows = jnp.where(live, jnp.clip(q_lens[seq] - first, 0, block_q), 0)
    ctx_len = jnp.where(live, kv_lens[seq] - q_lens[seq], 0)
    pos0 = ctx_len + jnp.where(live, first, 0)
    token_base = jnp.where(live, cu_q_lens[seq] - ctx_len, 0)  # token index = position + this
    zero = jnp.zeros_like(rows)
    meta = jnp.stack([rows, pos0, seq * pages_per_seq, ctx_len, token_base, zero, zero, zero],
                     axis=1)

    t = jnp.arange(num_tokens, dtype=jnp.int32)
    tseq, _, tvalid = token_positions(kv_lens, cu_q_lens, num_seqs, num_tokens)
    if select is not None:
        tvalid = tvalid & select[tseq]
    offset = t - cu_q_lens[tseq]
    token_item = jnp.where(tvalid, cu_blocks[tseq] + offset // block_q, 0)
    token_row = jnp.where(tvalid, offset % block_q, 0)
    return meta, token_item, token_row, tvalid


def combine(o: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """Merge C partial softmaxes: o [C, ..., D] unnormalised, m/l [C, ...] -> [..., D]."""
    m_max = jnp.max(m, axis=0)
    a = jnp.exp(m - m_max[None])
    l_tot = jnp.sum(a * l, axis=0)
    o = jnp.sum(a[..., None] * o, axis=0)
    return o / jnp.where(l_tot > 0, l_tot, 1.0)[..., None]


def q_blocks(q: jax.Array, meta: jax.Array, num_kv_heads: int, block_q: int, gp: int,
              padded_dim: int) -> jax.Array:
    """q [T, Hq, D] -> [W, Hkv, bq * Gp, Dp]; row r of a block is token r // Gp, head r % Gp;
    columns past D are zeros."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_items = meta.shape[0]
    group = num_q_heads // num_kv_heads
    i = jnp.arange(block_q, dtype=jnp.int32)
    rows, first_token = meta[:, 0], meta[:, 1] + meta[:, 4]
    row_token = jnp.where(i[None, :] < rows[:, None], first_token[:, None] + i[None, :],
                          num_tokens)  # [W, bq]; empty rows read the zero row
    blocks = jnp.concatenate([q, jnp.zeros((1, num_q_heads, head_dim), q.dtype)])[row_token]
    blocks = blocks.reshape(num_items, block_q, num_kv_heads, group, head_dim)
    blocks = jnp.pad(blocks, ((0, 0), (0, 0), (0, 0), (0, gp - group), (0, padded_dim - head_dim)))
    return blocks.transpose(0, 2, 1, 3, 4).reshape(num_items, num_kv_heads, block_q * gp, padded_dim)
