"""What the GPU kernel (gpu.py) takes, and its block sizes: checked and chosen before tracing.

`unsupported_reason` names the first shape or dtype the kernel cannot take (dispatch.py falls
back to the reference on it). `default_config` picks the block sizes and split count from the
batch's shape alone (all static under jit): a decode-like batch (at most two tokens per sequence)
gets query blocks of 16 rows, wide KV blocks and KV splits sized to fill the SMs; a prefill-like
batch gets blocks of 64-128 rows and no split. Every choice fits the device's shared memory:
`smem_bytes` is the footprint of a config (calibrated against Triton's own report on an H100:
f32, head_dim 256, 16 x 64 blocks, 2 stages asked for 348,224 bytes) and `default_config` shrinks
the KV block, then the pipeline depth, then the query block until it fits `smem_budget`.
A measured config from the tuned table (gpu_tuned.py) wins over the heuristic where one matches
the shape and fits. `default_paths` adds the run-time decode split: in a prefill-like batch the
sequences with one query token run in a call of their own with the decode blocks (`GpuPaths`).
`check_config` rejects a config the kernel cannot lower (Triton needs power-of-two dots of at
least 16 rows and columns).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from pallas_kernels import common, gpu_tuned

_FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
MAX_HEAD_DIM = 256

# Opt-in shared memory per thread block (bytes) and SM count, by device kind (prefix match).
# Hopper 227 KiB, Ampere A100 163 KiB, Ada / consumer Ampere 99 KiB.
_DEVICES = (
    ("NVIDIA H100", 232448, 132),
    ("NVIDIA H200", 232448, 132),
    ("NVIDIA H20", 232448, 78),
    ("NVIDIA GH200", 232448, 132),
    ("NVIDIA A100", 166912, 108),
    ("NVIDIA A800", 166912, 108),
    ("NVIDIA L4", 101376, 58),
    ("NVIDIA L40", 101376, 142),
    ("NVIDIA RTX", 101376, 84),
)
_FALLBACK = (101376, 108)  # an unknown GPU: the smallest budget above


@dataclasses.dataclass(frozen=True)
class GpuConfig:
    block_q: int  # query tokens per work item (power of two)
    block_kv: int  # keys per online-softmax step (power of two >= 16)
    num_splits: int  # KV splits per work item (1 = no combine step)
    num_warps: int = 4
    num_stages: int = 2


@dataclasses.dataclass(frozen=True)
class GpuPaths:
    """Two kernel calls over one batch, split at run time by each sequence's query length:
    `decode` takes the sequences with one query token (an item each), `rest` all others."""

    decode: GpuConfig
    rest: GpuConfig


def current_device_kind() -> str:
    """The default GPU's kind; off a GPU (lowering for CUDA from the CPU), an H100's."""
    return jax.devices()[0].device_kind if jax.default_backend() == "gpu" else "NVIDIA H100 80GB HBM3"


def device_limits(device_kind: str | None = None) -> tuple[int, int]:
    """(shared memory bytes per block, SM count) of a GPU kind; the default device's if None."""
    device_kind = device_kind or current_device_kind()
    for prefix, smem, sms in _DEVICES:
        if device_kind.startswith(prefix):
            return smem, sms
    return _FALLBACK


def padded_head_dim(head_dim: int) -> int:
    """The kernel works on head_dim rounded up to a power of two >= 16 (padding is masked)."""
    return max(16, common.next_pow2(head_dim))


def smem_bytes(config: GpuConfig, gp: int, head_dim: int, dtype: DTypeLike) -> int:
    """Shared memory one program of `config` needs: num_stages pipelined K and V tiles plus one
    K tile for the transposed dot operand, the q tile and the probabilities tile, all in the
    compute dtype (a quantized cache is converted before the dots)."""
    item = jnp.dtype(dtype).itemsize
    d = padded_head_dim(head_dim)
    rows = config.block_q * gp
    kv_tiles = (2 * config.num_stages + 1) * config.block_kv * d
    return item * (kv_tiles + rows * d + rows * config.block_kv) + 64


def unsupported_reason(q: jax.Array, kv_cache: jax.Array, page_indices: jax.Array) -> str | None:
    """None if the kernel takes these shapes, else why not (names the value)."""
    head_dim = q.shape[-1]
    page_size = kv_cache.shape[1]
    if (reason := common.dtype_mismatch(q, kv_cache, _FLOAT_DTYPES)) is not None:
        return reason
    if not 8 <= head_dim <= MAX_HEAD_DIM or head_dim % 8:
        return f"head_dim={head_dim} (want a multiple of 8 in [8, {MAX_HEAD_DIM}])"
    if page_size & (page_size - 1):
        return f"page_size={page_size} (want a power of two)"
    return None


def is_decode_like(num_tokens: int, num_seqs: int) -> bool:
    """A batch of at most two query tokens per sequence slot: the decode block sizes suit it."""
    return num_tokens <= 2 * num_seqs


def _fit(config: GpuConfig, gp: int, head_dim: int, dtype: DTypeLike, budget: int) -> GpuConfig:
    """Shrink block_kv (to 32), then num_stages (to 1), then block_q, then block_kv (to 16)."""
    fits = lambda c: smem_bytes(c, gp, head_dim, dtype) <= budget  # noqa: E731
    while not fits(config) and config.block_kv > 32:
        config = dataclasses.replace(config, block_kv=config.block_kv // 2)
    if not fits(config):
        config = dataclasses.replace(config, num_stages=1)
    while not fits(config) and config.block_q * gp > 16:
        config = dataclasses.replace(config, block_q=config.block_q // 2)
    while not fits(config) and config.block_kv > 16:
        config = dataclasses.replace(config, block_kv=config.block_kv // 2)
    return config


def default_config(
    num_tokens: int,
    num_seqs: int,
    group: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    pages_per_seq: int,
    dtype: DTypeLike = jnp.bfloat16,
    device_kind: str | None = None,
) -> GpuConfig:
    device_kind = device_kind or current_device_kind()
    budget, num_sms = device_limits(device_kind)
    gp = common.next_pow2(group)
    d = padded_head_dim(head_dim)
    decode_like = is_decode_like(num_tokens, num_seqs)
    rows = 16 if decode_like else (128 if d <= 128 else 64)
    block_q = max(1, rows // gp)
    max_kv = pages_per_seq * page_size
    block_kv = 128 if decode_like and d <= 128 else 64
    block_kv = max(16, min(block_kv, common.next_pow2(max_kv)))
    num_warps = 8 if block_q * gp >= 128 else 4
    # Decode streams gathered K/V once: software pipelining (2 stages) only adds shared memory
    # and latency there (H100, b=1 ctx=4k: 41 us with 2 stages, 28 us with 1).
    stages = 1 if decode_like else 2
    config = _fit(GpuConfig(block_q, block_kv, 1, num_warps, stages), gp, head_dim, dtype, budget)
    if decode_like:
        programs = num_seqs * num_kv_heads
        kv_blocks = -(-max_kv // config.block_kv)
        # Up to 16 splits, 32 from 128 KV blocks up (H200, b=1: 16k context 0.046 ms with 32
        # splits vs 0.070 with 16; at 4k, 16 splits 0.027 ms vs 0.034 with 32).
        cap = 32 if kv_blocks >= 128 else 16
        splits = max(1, min(cap, kv_blocks, common.next_pow2(-(-2 * num_sms // programs))))
        config = dataclasses.replace(config, num_splits=splits)
    tuned = gpu_tuned.lookup(
        device_kind,
        head_dim,
        group,
        page_size,
        jnp.dtype(dtype).name,
        "decode" if decode_like else "prefill",
        num_seqs,
        max_kv,
    )
    if tuned is not None:  # a measured config, if it fits this device and lowers
        candidate = GpuConfig(**tuned)
        if smem_bytes(candidate, gp, head_dim, dtype) <= budget and _lowers(candidate, gp):
            return candidate
    return config


def default_paths(
    num_tokens: int,
    num_seqs: int,
    group: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    pages_per_seq: int,
    dtype: DTypeLike = jnp.bfloat16,
    device_kind: str | None = None,
) -> GpuConfig | GpuPaths:
    """A decode-like batch: one call with `default_config`'s decode blocks. Otherwise a prefill
    chunk's query blocks would carry each decode token alone in 64-128 rows with two pipeline
    stages; such a batch splits (`GpuPaths`): its decode tokens, at most min(T, S) of them, get
    the decode config of that many sequences, and every other sequence the batch's config."""
    shape = (group, num_kv_heads, head_dim, page_size, pages_per_seq, dtype, device_kind)
    config = default_config(num_tokens, num_seqs, *shape)
    if is_decode_like(num_tokens, num_seqs):
        return config
    decodes = min(num_tokens, num_seqs)
    return GpuPaths(decode=default_config(decodes, decodes, *shape), rest=config)


def _lowers(config: GpuConfig, gp: int) -> bool:
    try:
        check_config(config, gp)
    except common.UnsupportedShape:
        return False
    return True


def check_config(config: GpuConfig | GpuPaths, gp: int) -> None:
    """Raises UnsupportedShape unless block_q * Gp and block_kv are powers of two >= 16."""
    if isinstance(config, GpuPaths):
        check_config(config.decode, gp)
        check_config(config.rest, gp)
        return
    bq, bkv = config.block_q, config.block_kv
    if bq * gp < 16 or bkv < 16 or bq & (bq - 1) or bkv & (bkv - 1):
        raise common.UnsupportedShape(
            f"pallas_gpu config {config}: block_q * Gp and block_kv must be powers of two >= 16"
        )
