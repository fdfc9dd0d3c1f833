"""The TPU kernels' blocks for a batch shape, fitted to the target chip's VMEM (tpu.py asks).

`default_paths` picks each path's blocks from the batch's shape alone (all static under jit): the
decode kernel takes up to 8 sequences and 2048 positions per step; the ragged kernel's mixed path
query blocks of 16 tokens, its prefill path blocks of about 256 rows (G * block_q), a KV step of
whole pages up to 512 positions (at least one page). `default_config` is the single ragged
call's: query blocks of 16 tokens for a decode-like batch (at most two tokens per sequence), else
the prefill size.
Those blocks are then fitted to the target chip's VMEM (`fit_vmem`; `vmem_bytes`: every kv head's
q and out blocks, the key buffers, the softmax state and one head's temporaries, second-minor
axes in whole sublane tiles, within 3/8 of jax's per-TensorCore capacity for the chip: v5e / v6e
128 MiB, v5p / 7x 64 MiB, v4 16 MiB), shrinking the KV step first, then the query block (or the
sequences per step); past Mosaic's default scoped limit (16 MiB) a config asks for twice what it
needs (within 3/4 of the capacity). The configs and what the kernels take: tpu_config.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from pallas_kernels import common
from pallas_kernels.tpu_config import KV_SCRATCH_BUFFERS, DecodeConfig, TpuConfig, TpuPaths, sublane_rows


def default_config(
    num_tokens: int,
    num_seqs: int,
    group: int,
    num_kv_heads: int,
    page_size: int,
    pages_per_seq: int,
    head_dim: int = 128,
    dtype: DTypeLike = jnp.bfloat16,
    cache_dtype: DTypeLike | None = None,
    chip: str | None = None,
) -> TpuConfig:
    """Ragged-kernel blocks for this batch shape, fitted to `chip`'s VMEM (default: `target_chip()`)."""
    config = _shape_config(num_tokens, num_seqs, group, page_size, pages_per_seq)
    return fit_vmem(
        config,
        group,
        num_kv_heads,
        page_size,
        head_dim,
        dtype,
        cache_dtype or dtype,
        vmem_capacity(chip or target_chip()),
    )


def default_paths(
    num_tokens: int,
    num_seqs: int,
    group: int,
    num_kv_heads: int,
    page_size: int,
    pages_per_seq: int,
    head_dim: int = 128,
    dtype: DTypeLike = jnp.bfloat16,
    cache_dtype: DTypeLike | None = None,
    chip: str | None = None,
) -> TpuPaths:
    """Blocks of the three paths, each fitted to `chip`'s VMEM: decode takes up to 8 sequences
    and 2048 positions per step; mixed (short multi-token sequences: speculative verification,
    short chunks) query blocks of 16 tokens; prefill about 256 rows (G * block_q)."""
    cache_dtype = cache_dtype or dtype
    capacity = vmem_capacity(chip or target_chip())
    pages = max(1, min(pages_per_seq, 512 // page_size))
    prefill = _shape_config(num_tokens, 1, group, page_size, pages_per_seq)  # prefill-like
    mixed = TpuConfig(16, pages)
    decode = DecodeConfig(max(1, min(8, num_tokens, num_seqs)), max(1, min(pages_per_seq, 2048 // page_size)))
    fit = functools.partial(
        fit_vmem,
        group=group,
        num_kv_heads=num_kv_heads,
        page_size=page_size,
        head_dim=head_dim,
        dtype=dtype,
        cache_dtype=cache_dtype,
        capacity=capacity,
    )
    return TpuPaths(fit(decode), fit(mixed), fit(prefill))


def _shape_config(num_tokens: int, num_seqs: int, group: int, page_size: int, pages_per_seq: int) -> TpuConfig:
    if num_tokens <= 2 * num_seqs:  # decode-like: one token per sequence, keep wasted rows few
        block_q = 16
    else:
        block_q = max(16, min(256, common.next_pow2(-(-256 // group))))
    block_q = min(block_q, max(16, common.next_pow2(num_tokens)))
    pages_per_block = max(1, min(pages_per_seq, 512 // page_size))
    return TpuConfig(block_q, pages_per_block)


# jax's TPU device kinds -> chip versions of its table (pltpu.get_tpu_info_for_chip).
_CHIPS = (
    ("TPU v5 lite", "v5e"),
    ("TPU v5e", "v5e"),
    ("TPU v6 lite", "v6e"),
    ("TPU v6e", "v6e"),
    ("TPU7x", "7x"),
    ("TPU v7", "7x"),
    ("TPU v5p", "v5p"),
    ("TPU v5", "v5p"),
    ("TPU v4", "v4"),
)
DEFAULT_SCOPED_VMEM = 16 << 20  # Mosaic's default limit on v5e (32 MiB from v6e): asked past it


def target_chip() -> str:
    """The chip the kernel is built for: this process's TPU; when lowering for a TPU from
    elsewhere, the abstract mesh's device; else v5e."""
    kind = jax.devices()[0].device_kind if jax.default_backend() == "tpu" else None
    device = common.mesh_device()
    if kind is None and device is not None and device.platform == "tpu":
        kind = device.device_kind
    return next((chip for prefix, chip in _CHIPS if kind and kind.startswith(prefix)), "v5e")


def vmem_capacity(chip: str) -> int:
    """VMEM bytes of one TensorCore of `chip` ("v5e", "v6e", "7x", ...), from jax's table."""
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.get_tpu_info_for_chip(pltpu.ChipVersion(chip), 1).vmem_capacity_bytes


_LANES = 128  # a [M, 1] float32 array takes a full 128-lane row per sublane in VMEM


def _padded_rows(rows: int, dtype: DTypeLike) -> int:
    """Rows of a second-minor axis as VMEM holds them: whole (sublane) tiles."""
    return -(-rows // sublane_rows(dtype)) * sublane_rows(dtype)


def vmem_bytes(
    config: TpuConfig | DecodeConfig,
    group: int,
    num_kv_heads: int,
    page_size: int,
    head_dim: int,
    dtype: DTypeLike,
    cache_dtype: DTypeLike,
) -> int:
    """VMEM one grid step of a kernel holds.

    Ragged kernel: the q and out blocks [Hkv, M, D] (double-buffered by the pipeline), the two
    [2, N, 2Hkv, D] key buffers, the softmax state (m and l padded to full lanes), and one head's
    temporaries: the [M, N] scores, probabilities and index planes (4 bytes each), the selected
    [N, D] K and V, and the state's update. Decode kernel: q and out blocks [Hkv, B, G, D], this
    step's rows [B, 2Hkv, D], one key buffer, and one sequence's state and temporaries with G
    rows. Second-minor axes count whole sublane tiles, head_dim whole 128-lane rows (head_dim 64
    takes twice its bytes: a llama-3.2-1b decode step on v6e needed 89.6 MiB where the count
    without lane padding said 43)."""
    head_dim = -(-head_dim // _LANES) * _LANES
    q_size, kv_size = jnp.dtype(dtype).itemsize, jnp.dtype(cache_dtype).itemsize
    n = config.pages_per_block * page_size
    key_rows = _padded_rows(2 * num_kv_heads, cache_dtype)
    if isinstance(config, DecodeConfig):
        rows, buffers = _padded_rows(group, dtype), 1
        blocks = 2 * 2 * num_kv_heads * config.seqs_per_block * rows * head_dim * q_size
        blocks += 2 * config.seqs_per_block * key_rows * head_dim * kv_size
        state_rows = rows
    else:
        rows, buffers = group * config.block_q, KV_SCRATCH_BUFFERS
        blocks = 2 * 2 * num_kv_heads * rows * head_dim * q_size
        state_rows = num_kv_heads * rows
    scratch = buffers * 2 * n * key_rows * head_dim * kv_size
    state = state_rows * (head_dim + 2 * _LANES) * 4
    temporaries = 4 * rows * n * 4 + 3 * n * head_dim * 4 + 2 * rows * (head_dim + 2) * 4
    return blocks + scratch + state + temporaries


def fit_vmem[C: (TpuConfig, DecodeConfig)](
    config: C,
    group: int,
    num_kv_heads: int,
    page_size: int,
    head_dim: int,
    dtype: DTypeLike,
    cache_dtype: DTypeLike,
    capacity: int,
) -> C:
    """`config` shrunk (KV step, then query block or sequences per step) until it needs at most
    3/8 of `capacity`, asking for a scoped limit of twice its need (within 3/4 of `capacity`)
    past the default."""

    def need(c):
        return vmem_bytes(c, group, num_kv_heads, page_size, head_dim, dtype, cache_dtype)

    budget = capacity * 3 // 8
    rows, least = ("seqs_per_block", 1) if isinstance(config, DecodeConfig) else ("block_q", 16)
    while need(config) > budget and config.pages_per_block > 1:
        config = dataclasses.replace(config, pages_per_block=config.pages_per_block // 2)
    while need(config) > budget and getattr(config, rows) > least:
        config = dataclasses.replace(config, **{rows: getattr(config, rows) // 2})
    if 2 * need(config) > DEFAULT_SCOPED_VMEM:
        limit = min(capacity * 3 // 4, -(-2 * need(config) // (1 << 20)) << 20)
        config = dataclasses.replace(config, vmem_limit_bytes=limit)
    return config
