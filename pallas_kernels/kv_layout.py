"""The paged KV cache's layout in device memory: row-major, the order every kernel reads.

XLA gives each array a device layout chosen by its shape. For a [P, page, 2K, D] cache with
D < 128 a TPU's choice puts a major axis minor (no padding of the 128-lane rows), so a step would
relay each layer's cache to row-major around the Pallas kernels and back: two copies of the whole
cache per layer per step, and temporaries of its size. The caches are therefore allocated and
carried through every jit in a pinned row-major `Format`. On a TPU its tiles pad the last two axes
(head_dim 64 to 128 lanes, as tpu-inference pads head_dim to 128; few rows of 2K to the tile's
sublanes), and `layout_bytes` counts those padded bytes so the pool is planned by what it holds.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout
from jax.sharding import SingleDeviceSharding
from jax.typing import DTypeLike

TILED_PLATFORMS = ("tpu",)  # where an array's bytes in memory exceed its element count's


def kv_cache_format(sharding: jax.sharding.Sharding, ndim: int = 4) -> Format:
    """The cache's placement with its row-major layout pinned (`ndim` 5 with a leading [data] axis)."""
    return Format(Layout(major_to_minor=tuple(range(ndim))), sharding)


@functools.cache
def _compiled_bytes(shape: tuple[int, ...], dtype: jnp.dtype, device: jax.Device) -> int:
    zeros = jax.jit(
        lambda: jnp.zeros(shape, dtype), out_shardings=kv_cache_format(SingleDeviceSharding(device), len(shape))
    )
    return int(zeros.trace().lower().compile().memory_analysis().output_size_in_bytes)


def layout_bytes(shape: tuple[int, ...], dtype: DTypeLike, device: jax.Device) -> int:
    """Bytes an array of `shape` takes on `device` in the cache's row-major layout, tile padding
    included: XLA's own count where the platform tiles (zeros of that shape compiled for the
    device, nothing run), the elements' bytes elsewhere."""
    dtype = jnp.dtype(dtype)
    if getattr(device, "platform", None) not in TILED_PLATFORMS:
        return int(np.prod(shape)) * dtype.itemsize
    return _compiled_bytes(tuple(int(n) for n in shape), dtype, device)
