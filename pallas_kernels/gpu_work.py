"""The GPU kernel's work list (XLA around the pallas_call of gpu.py).

`work_list` cuts the ragged batch into work items of at most block_q query tokens of one
sequence (step 2 of gpu.py's docstring); `new_kv` is this step's K/V as the cache stores them;
`combine` merges the partial softmaxes of a split-K call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.typing import DTypeLike

from pallas_kernels import common
from pallas_kernels.common import token_positions
from pallas_kernels.kv_write import stored_k_v

META_WIDTH = 8  # rows, pos0, table offset, ctx_len, token offset, zero rows, first zero token, 0


def work_list(
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    num_seqs: jax.Array,
    num_tokens: int,
    block_q: int,
    pages_per_seq: int,
    *,
    select: jax.Array | None = None,
    num_items: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per work item: meta [W, 8] = (rows, first row's position, page-table offset, cached
    context length, token index minus position, padding rows to zero, first of them, 0); per
    token: (written by this call, real).

    `select` (bool [S]) keeps only those sequences' tokens: the others get no items. `num_items`
    (static) bounds the items where the caller knows a tighter bound than a block per block_q
    tokens plus a partial one per sequence (one item per selected decode sequence). Without it,
    the items left idle zero the padding tokens [cu_q_lens[num_seqs], T), block_q at a time:
    there are always enough of them (W - items >= (T - real tokens) / block_q)."""
    num_seqs_max = kv_lens.shape[0]
    q_lens = common.real_q_lens(cu_q_lens, num_seqs)  # [S]
    taken = q_lens if select is None else jnp.where(select, q_lens, 0)
    blocks = (taken + block_q - 1) // block_q
    cu_blocks = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(blocks, dtype=jnp.int32)])
    zero_fill = num_items is None
    num_items = num_items or pl.cdiv(num_tokens, block_q) + num_seqs_max
    w = jnp.arange(num_items, dtype=jnp.int32)
    seq = common.bucket_of(cu_blocks[1:], w)
    seq = jnp.minimum(seq, num_seqs_max - 1)
    live = w < cu_blocks[num_seqs_max]
    first = (w - cu_blocks[seq]) * block_q  # offset of row 0 inside its sequence
    rows = jnp.where(live, jnp.clip(q_lens[seq] - first, 0, block_q), 0)
    ctx_len = jnp.where(live, kv_lens[seq] - q_lens[seq], 0)
    pos0 = ctx_len + jnp.where(live, first, 0)
    token_base = jnp.where(live, cu_q_lens[seq] - ctx_len, 0)  # token index = position + this
    real_tokens = cu_q_lens[common.scalar_num_seqs(num_seqs)[0]]
    zero_first = real_tokens + (w - cu_blocks[num_seqs_max]) * block_q
    zero_rows = jnp.where(live | (not zero_fill), 0, jnp.clip(num_tokens - zero_first, 0, block_q))
    meta = jnp.stack(
        [
            rows,
            pos0,
            seq * pages_per_seq,
            ctx_len,
            token_base,
            zero_rows,
            jnp.where(zero_rows > 0, zero_first, 0),
            jnp.zeros_like(rows),
        ],
        axis=1,
    )

    tseq, _, real = token_positions(kv_lens, cu_q_lens, num_seqs, num_tokens)
    mine = real if select is None else real & select[tseq]
    return meta, mine, real


def combine(o: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """Merge C partial softmaxes: o [C, ..., D] unnormalised, m/l [C, ...] -> [..., D]."""
    m_max = jnp.max(m, axis=0)
    a = jnp.exp(m - m_max[None])
    l_tot = jnp.sum(a * l, axis=0)
    o = jnp.sum(a[..., None] * o, axis=0)
    return o / jnp.where(l_tot > 0, l_tot, 1.0)[..., None]


def new_kv(
    k: jax.Array,
    v: jax.Array,
    cache_dtype: DTypeLike,
    padded_dim: int,
    k_scale: jax.Array | None,
    v_scale: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    """`kv_write.stored_k_v` with columns past D zero ([T, Hkv, Dp] each): k and v themselves
    for a cache of their dtype and a power-of-two head_dim."""
    k, v = stored_k_v(k, v, cache_dtype, k_scale, v_scale)
    pad = ((0, 0), (0, 0), (0, padded_dim - k.shape[-1]))
    return jnp.pad(k, pad), jnp.pad(v, pad)
