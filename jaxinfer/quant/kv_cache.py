"""Quantized KV caches: int8 or fp8 (e4m3) pages with one static scale per KV head, for K and V.

A quantized layer cache is a pytree of two arrays of the same rank:

    pages:  [P, page, 2K, D]  int8 | float8_e4m3fn   the kernel layout (pallas_kernels.reference)
    scales: [1, 1, 2K, 1]     float32                 the scale of each entry of the third axis

so a stored value is x / scale and `pages * scales` is the cache read back in float. K of head h
sits at 2h and V at 2h + 1 on both arrays, which is why one partition spec splits them alike over
a mesh (KV heads over `tensor`, a leading [data] axis for replicas): the scales travel with the
heads they belong to, repeated KV heads included. The kernel contract takes the scales as
`k_scale`, `v_scale` f32[K]; `k_scale` / `v_scale` slice them out of this layout.

Scales are static: chosen once when the engine starts (jaxinfer/worker/kv_calibration.py) and never
changed, so every page, whenever written, is read back with the scale it was written with. The
unquantized engine keeps a plain array per layer; model code passes either form through to
`layers.paged_attention` untouched.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

# Names EngineConfig.kv_cache_dtype accepts for a quantized cache, and their storage dtypes.
QUANTIZED_KV_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn}
FLOAT_KV_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


@flax.struct.dataclass
class QuantizedKVCache:
    """One layer's quantized pages and their per-head scales (see the module docstring)."""

    pages: jax.Array  # [P, page, 2K, D] int8 | float8_e4m3fn
    scales: jax.Array  # f32[1, 1, 2K, 1]

    @property
    def k_scale(self) -> jax.Array:
        """f32[K]: the scale of each KV head's keys."""
        return self.scales.reshape(-1)[0::2]

    @property
    def v_scale(self) -> jax.Array:
        """f32[K]: the scale of each KV head's values."""
        return self.scales.reshape(-1)[1::2]


def kv_pages(cache: jax.Array | QuantizedKVCache) -> jax.Array:
    """A cache's pages [..., P, page, 2K, D]: the array itself, or a quantized cache's stored pages."""
    return cache.pages if isinstance(cache, QuantizedKVCache) else cache


def with_kv_pages(cache: jax.Array | QuantizedKVCache, pages: jax.Array) -> jax.Array | QuantizedKVCache:
    """`cache` holding `pages` instead (a quantized cache keeps its scales)."""
    return dataclasses.replace(cache, pages=pages) if isinstance(cache, QuantizedKVCache) else pages


def resolve_kv_dtype(name: str, model_dtype: DTypeLike) -> np.dtype:
    """EngineConfig.kv_cache_dtype -> the cache's storage dtype ("auto": the model's dtype)."""
    if name == "auto":
        return jnp.dtype(model_dtype)
    table = {**FLOAT_KV_DTYPES, **QUANTIZED_KV_DTYPES}
    if name not in table:
        raise ValueError(f"kv_cache_dtype={name!r}: expected 'auto' or one of {sorted(table)}")
    return jnp.dtype(table[name])


def is_quantized_kv(dtype: DTypeLike) -> bool:
    return jnp.dtype(dtype).itemsize == 1


def quant_max(dtype: DTypeLike) -> float:
    """The largest magnitude the storage dtype holds: 127 for int8, 448 for fp8 e4m3."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return float(jnp.iinfo(dtype).max)
    return float(jnp.finfo(dtype).max)


def scales_from_absmax(absmax: np.ndarray, dtype: DTypeLike, headroom: float) -> np.ndarray:
    """Per-entry scales that map `headroom` x the observed |x| maximum to the dtype's largest
    value. A head that never saw a nonzero value gets scale 1 (anything it stores is exact zero
    or clipped the same way at either scale)."""
    absmax = np.asarray(absmax, np.float32)
    scale = absmax * np.float32(headroom) / np.float32(quant_max(dtype))
    return np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)


def scales_array(scales: np.ndarray) -> np.ndarray:
    """f32[2K] (K of head h at 2h, V at 2h + 1) -> the broadcastable [1, 1, 2K, 1] layout."""
    return np.asarray(scales, np.float32).reshape(1, 1, -1, 1)
