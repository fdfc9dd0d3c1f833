"""What the GPU kernel (gpu.py) takes, and its block sizes: checked and chosen before tracing.

`unsupported_reason` names the first shape or dtype the kernel cannot take (dispatch.py falls
back to the reference on it). `default_config` picks the block sizes and split count from the
batch's shape alone (all static under jit): a decode-like batch (at most two tokens per sequence)
gets query blocks of 16 rows, wide KV blocks and up to 16 KV splits, aiming at two programs per
SM; a prefill-like batch gets blocks of 64-128 rows and no split. `check_config` rejects a config
the kernel cannot lower (Triton needs power-of-two dots of at least 16 rows and columns).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import common

_NUM_SMS = 132  # H100 SXM; only steers the split-K heuristic.
_FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


@dataclasses.dataclass(frozen=True)
class GpuConfig:
    block_q: int     # query tokens per work item (power of two)
    block_kv: int    # keys per online-softmax step (power of two >= 16)
    num_splits: int  # KV splits per work item (1 = no combine step)
    num_warps: int = 4
    num_stages: int = 2


def unsupported_reason(q: jax.Array, kv_cache: jax.Array, page_indices: jax.Array) -> str | None:
    """None if the kernel takes these shapes, else why not (names the value)."""
    head_dim = q.shape[-1]
    page_size = kv_cache.shape[1]
    if (reason := common.dtype_mismatch(q, kv_cache, _FLOAT_DTYPES)) is not None:
        return reason
    if head_dim not in (16, 32, 64, 128, 256):
        return f"head_dim={head_dim} (want a power of two in [16, 256])"
    if page_size & (page_size - 1):
        return f"page_size={page_size} (want a power of two)"
    return None


def default_config(num_tokens: int, num_seqs: int, group: int, num_kv_heads: int,
                   head_dim: int, page_size: int, pages_per_seq: int) -> GpuConfig:
    gp = common.next_pow2(group)
    decode_like = num_tokens <= 2 * num_seqs
    rows = 16 if decode_like else (128 if head_dim <= 128 else 64)
    block_q = max(1, rows // gp)
    max_kv = pages_per_seq * page_size
    block_kv = 128 if decode_like and head_dim <= 128 else 64
    block_kv = max(16, min(block_kv, common.next_pow2(max_kv)))
    num_splits = 1
    if decode_like:
        programs = num_seqs * num_kv_heads
        kv_blocks = -(-max_kv // block_kv)
        num_splits = max(1, min(16, kv_blocks, common.next_pow2(-(-2 * _NUM_SMS // programs))))
    num_warps = 8 if block_q * gp >= 128 else 4
    return GpuConfig(block_q, block_kv, num_splits, num_warps, 2)


def check_config(config: GpuConfig, gp: int) -> None:
    """Raises UnsupportedShape unless block_q * Gp and block_kv are powers of two >= 16."""
    bq, bkv = config.block_q, config.block_kv
    if bq * gp < 16 or bkv < 16 or bq & (bq - 1) or bkv & (bkv - 1):
        raise common.UnsupportedShape(f"pallas_gpu config {config}: block_q * Gp and block_kv "
                                      "must be powers of two >= 16")
