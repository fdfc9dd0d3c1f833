"""Attention kernels for jaxinfer: ragged paged attention behind one function.

`ragged_paged_attention` implements the contract in docs/design/architecture.md. `impl` picks the pure-jnp
reference (the CPU path and the oracle, reference.py), the Pallas GPU kernel (Triton lowering,
gpu.py) or the Pallas TPU kernel (Mosaic, tpu.py); "auto" chooses by backend and falls back to the
reference, with one logged warning per cause, for shapes a kernel cannot take (dispatch.py).

The GPU kernel: gpu.py (the entry, its inputs and pallas_call, the decode split), gpu_kernel.py
(the kernel body and the call's BlockSpecs), gpu_work.py (the work list around the call),
gpu_config.py and gpu_tuned.py (block sizes; measured ones). The TPU kernels: tpu.py (the entry
and its three paths), tpu_decode.py and tpu_ragged.py (the kernels), tpu_layout.py and
tpu_rows.py (their operands' layouts), tpu_config.py (the configs and what the kernels take),
tpu_blocks.py (a batch shape's blocks, fitted to the chip's VMEM). Shared: common.py (checks and
the online softmax), kv_write.py (the step's K/V written into the pages, as every path stores
them), kv_layout.py (the cache's layout in device memory). split_rows.py: attention over one
shard's rows of every page, for a cache split along the sequence (sharding/attention.py).
"""

from __future__ import annotations

from pallas_kernels.dispatch import ragged_paged_attention, target_backend
from pallas_kernels.kv_write import kv_cache_shape
from pallas_kernels.reference import ragged_paged_attention_reference

__all__ = ["kv_cache_shape", "ragged_paged_attention", "ragged_paged_attention_reference", "target_backend"]
