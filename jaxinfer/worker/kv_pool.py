"""The paged KV pool: how many pages fit one device's budget, counted in the bytes the device
really holds (a TPU's tile padding included), and each layer's zeroed cache in the row-major
layout the attention kernels read (pallas_kernels.kv_layout), pinned so no step relays it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.config.cache import DEFAULT_PAGE_SIZE
from jaxinfer.config.kv_layout import kv_layout
from pallas_kernels import kv_cache_shape
from pallas_kernels.kv_layout import kv_cache_format, layout_bytes

CPU_DEFAULT_KV_BYTES = 1 << 30


def kv_page_bytes(
    config: ModelConfig,
    page_size: int,
    dtype: DTypeLike,
    num_kv_heads: int | None = None,
    device: jax.Device | None = None,
    num_caches: int | None = None,
) -> int:
    """Bytes one page costs on `device` (default: the first local device) when it holds
    `num_kv_heads` heads: one layer's page in each cache of the model's KV layout (every layer's
    where the layers attend alike; config/kv_layout.py), or in `num_caches` caches (a pipeline
    stage's devices hold only their stage's slots)."""
    heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
    device = jax.local_devices()[0] if device is None else device
    per_layer = layout_bytes(kv_cache_shape(1, page_size, heads, config.head_dim), dtype, device)
    return per_layer * (kv_layout(config).num_caches if num_caches is None else num_caches)


def plan_num_pages(
    config: ModelConfig,
    engine: EngineConfig,
    dtype: DTypeLike,
    num_kv_heads: int | None = None,
    device: jax.Device | None = None,
    num_caches: int | None = None,
    row_split: int = 1,
) -> int:
    """Pages per replica: given, or as many as fit one device's budget (`num_caches`: the caches
    one device holds, kv_page_bytes; `row_split`: the shards a page's rows split over, each
    device holding page_size / row_split of them: sequence=N)."""
    if engine.cache.num_pages is not None:
        return engine.cache.num_pages
    device = jax.local_devices()[0] if device is None else device
    budget = engine.cache.kv_cache_bytes
    if budget is None:
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
            budget = int(free * engine.cache.kv_cache_memory_fraction)
        else:
            budget = CPU_DEFAULT_KV_BYTES
    page_size = engine.cache.page_size or DEFAULT_PAGE_SIZE  # as the device state resolves it off the TPU kernel
    return max(2, budget // kv_page_bytes(config, page_size // row_split, dtype, num_kv_heads, device, num_caches))


def cache_struct(
    num_pages: int,
    page_size: int,
    cache_kv_heads: int,
    head_dim: int,
    dtype: DTypeLike,
    sharding: jax.sharding.Sharding,
    replicas: int = 1,
    stages: int = 1,
) -> jax.ShapeDtypeStruct:
    """One layer's cache as the device state allocates it: [P, page, 2K, D] ([data, ...] with several
    replicas; [P, stages*page, ...] with pipeline stages, each stage's rows on its devices), placed
    by `sharding`, its row-major layout pinned."""
    shape: tuple[int, ...] = kv_cache_shape(num_pages, page_size * stages, cache_kv_heads, head_dim)
    if replicas > 1:
        shape = (replicas, *shape)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=kv_cache_format(sharding, len(shape)))


def zeroed_caches(struct: jax.ShapeDtypeStruct, num_caches: int) -> tuple[jax.Array, ...]:
    """`num_caches` zeroed caches of `struct` (its placement and layout)."""
    zeros = jax.jit(lambda: jnp.zeros(struct.shape, struct.dtype), out_shardings=struct.format)
    return tuple(zeros() for _ in range(num_caches))
