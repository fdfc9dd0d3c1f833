"""What the TPU kernel (tpu.py) takes, and its block sizes: checked and chosen before tracing.

`unsupported_reason` names the first shape or dtype the kernel cannot take (dispatch.py falls
back to the reference on it). `default_config` picks the block sizes from the batch's shape alone
(all static under jit): a decode-like batch (at most two tokens per sequence) gets query blocks
of 16 tokens so few rows are wasted; a prefill-like batch gets blocks of about 256 rows
(G * block_q); a KV step takes whole pages, up to 512 positions (at least one page).
`check_config` rejects a config the kernel cannot tile.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from pallas_kernels import common

_FLOAT_DTYPES = (jnp.bfloat16, jnp.float32)


@dataclasses.dataclass(frozen=True)
class TpuConfig:
    block_q: int          # query tokens per block over the flattened T axis (power of two >= 16)
    pages_per_block: int  # pages per KV step; block_kv = pages_per_block * page_size
    vmem_limit_bytes: int | None = None


def _sublane_rows(dtype: DTypeLike) -> int:
    return 32 // jnp.dtype(dtype).itemsize  # rows per (sublane) tile: 8 for 32-bit, 16, 32


def unsupported_reason(q: jax.Array, kv_cache: jax.Array, page_indices: jax.Array) -> str | None:
    """None if the kernel takes these shapes, else why not (names the value)."""
    head_dim = q.shape[-1]
    page_size = kv_cache.shape[1]
    if (reason := common.dtype_mismatch(q, kv_cache, _FLOAT_DTYPES)) is not None:
        return reason
    if head_dim not in (64, 128, 256):
        return f"head_dim={head_dim} (want 64, 128 or 256)"
    if page_size % _sublane_rows(kv_cache.dtype):
        return (f"page_size={page_size} (want a multiple of {_sublane_rows(kv_cache.dtype)} "
                f"for {jnp.dtype(kv_cache.dtype).name})")
    return None


def default_config(num_tokens: int, num_seqs: int, group: int, page_size: int,
                   pages_per_seq: int) -> TpuConfig:
    if num_tokens <= 2 * num_seqs:  # decode-like: one token per sequence, keep wasted rows few
        block_q = 16
    else:
        block_q = max(16, min(256, common.next_pow2(-(-256 // group))))
    block_q = min(block_q, max(16, common.next_pow2(num_tokens)))
    pages_per_block = max(1, min(pages_per_seq, 512 // page_size))
    return TpuConfig(block_q, pages_per_block)


def check_config(config: TpuConfig) -> None:
    """Raises UnsupportedShape unless block_q is a power of two >= 16."""
    bq = config.block_q
    if bq < 16 or bq & (bq - 1):
        raise common.UnsupportedShape(f"pallas_tpu block_q={bq} must be a power of two >= 16")
