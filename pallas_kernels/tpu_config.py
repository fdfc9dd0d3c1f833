"""What the TPU kernels (tpu.py) take: their block configs, the shapes they refuse, their scratch.

`unsupported_reason` names the first shape or dtype the kernels cannot take (dispatch.py falls
back to the reference on it), among them a page table past the SMEM the kernels prefetch it into
(`table_page_size` is the page size whose table fits). `check_config` rejects a config the
kernels cannot tile. `kv_scratch_shape` and `softmax_state_shapes` are the ragged kernel's VMEM
scratch (tpu_ragged.py allocates them; tpu_blocks.py counts them). The blocks for a batch shape,
fitted to the target chip's VMEM, are chosen in tpu_blocks.py.
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
    """Blocks of the ragged kernel (tpu_ragged.py): the mixed and prefill paths."""

    block_q: int  # query tokens per block over the flattened T axis (power of two >= 16)
    pages_per_block: int  # pages per KV step; block_kv = pages_per_block * page_size
    vmem_limit_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Blocks of the decode kernel (tpu_decode.py)."""

    seqs_per_block: int  # decode sequences (one query token each) per grid step
    pages_per_block: int  # pages per KV step
    vmem_limit_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class TpuPaths:
    """The three static paths of one call (tpu.py): sequences of one query token take `decode`;
    the others take `prefill` from `prefill.block_q` query tokens up, `mixed` below that."""

    decode: DecodeConfig
    mixed: TpuConfig
    prefill: TpuConfig


def sublane_rows(dtype: DTypeLike) -> int:
    return 32 // jnp.dtype(dtype).itemsize  # rows per (sublane) tile: 8 for 32-bit, 16, 32


def unsupported_reason(q: jax.Array, kv_cache: jax.Array, page_indices: jax.Array) -> str | None:
    """None if the kernel takes these shapes, else why not (names the value)."""
    head_dim = q.shape[-1]
    page_size = kv_cache.shape[1]
    if (reason := common.dtype_mismatch(q, kv_cache, _FLOAT_DTYPES)) is not None:
        return reason
    if head_dim not in (64, 128, 256):
        return f"head_dim={head_dim} (want 64, 128 or 256)"
    if page_size % sublane_rows(kv_cache.dtype):
        return (
            f"page_size={page_size} (want a multiple of {sublane_rows(kv_cache.dtype)} "
            f"for {jnp.dtype(kv_cache.dtype).name})"
        )
    table = page_indices.size * 4
    if table > PAGE_TABLE_SMEM_BYTES:
        return (
            f"a page table of {page_indices.shape[0]} x {page_indices.shape[1]} pages "
            f"({table >> 10} KiB; the kernels hold it in SMEM, at most "
            f"{PAGE_TABLE_SMEM_BYTES >> 10} KiB): use larger pages, fewer sequences or a "
            f"shorter max_model_len"
        )
    return None


# Each pallas_call scalar-prefetches the step's whole page table into SMEM (1 MiB a TensorCore
# on v4 .. 7x); Mosaic refuses the compile past it ("Allocation ... would exceed memory"). Half
# of it leaves room for the other scalar operands (a table of 256 x 512 pages compiles for v5e;
# 256 x 2048 does not: tests/pallas_kernels/test_tpu_compile.py).
PAGE_TABLE_SMEM_BYTES = 512 << 10
MAX_TABLE_PAGE_SIZE = 1024


def table_page_size(num_seqs: int, max_model_len: int, least: int = 16) -> int:
    """The smallest power-of-two page size from `least` whose page table for `num_seqs`
    sequences of `max_model_len` tokens fits PAGE_TABLE_SMEM_BYTES (at most
    MAX_TABLE_PAGE_SIZE, where the table may still not fit)."""
    page = least
    while page < MAX_TABLE_PAGE_SIZE and num_seqs * -(-max_model_len // page) * 4 > PAGE_TABLE_SMEM_BYTES:
        page *= 2
    return page


KV_SCRATCH_BUFFERS = 2  # whole keys (all heads) from the cache, and from this step's stored rows


def kv_scratch_shape(config: TpuConfig, page_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
    """Each K/V scratch buffer: two slots (double buffering) of one KV step's keys, every head's
    K and V as the cache holds them ([N, 2Hkv, D])."""
    return (2, config.pages_per_block * page_size, 2 * num_kv_heads, head_dim)


def softmax_state_shapes(config: TpuConfig, num_kv_heads: int, group: int, head_dim: int) -> list[tuple[int, int, int]]:
    """The float32 online-softmax state of one query block, per kv head: m, l [Hkv, M, 1] and
    acc [Hkv, M, D]."""
    rows = group * config.block_q
    return [(num_kv_heads, rows, 1), (num_kv_heads, rows, 1), (num_kv_heads, rows, head_dim)]


def check_config(config: TpuConfig | DecodeConfig | TpuPaths) -> None:
    """Raises UnsupportedShape unless every block_q is a power of two >= 16 and every count of
    sequences or pages per step is positive."""
    if isinstance(config, TpuPaths):
        for part in (config.decode, config.mixed, config.prefill):
            check_config(part)
        return
    if config.pages_per_block < 1 or getattr(config, "seqs_per_block", 1) < 1:
        raise common.UnsupportedShape(f"pallas_tpu config {config}: block counts must be positive")
    if isinstance(config, DecodeConfig):
        return
    bq = config.block_q
    if bq < 16 or bq & (bq - 1):
        raise common.UnsupportedShape(f"pallas_tpu block_q={bq} must be a power of two >= 16")
