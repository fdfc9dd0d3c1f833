"""Attention kernels for jaxinfer: ragged paged attention behind one function.

`ragged_paged_attention` implements the contract in ARCHITECTURE.md. `impl` picks the pure-jnp
reference (the CPU path and the oracle, reference.py), the Pallas GPU kernel (Triton lowering,
gpu.py) or the Pallas TPU kernel (Mosaic, tpu.py); "auto" chooses by backend and falls back to the
reference, with one logged warning per cause, for shapes a kernel cannot take (dispatch.py).
"""

from __future__ import annotations

from pallas_kernels.dispatch import ragged_paged_attention, target_backend
from pallas_kernels.reference import kv_cache_shape, ragged_paged_attention_reference

__all__ = ["kv_cache_shape", "ragged_paged_attention", "ragged_paged_attention_reference", "target_backend"]
