"""GGUF quantized tensors kept quantized: decoded blocks repacked into QuantizedWeight.

    GGUF tensor bytes --gguf_blocks.decode--> integers [.., n] + scales [.., n/g] (tensor's shape)
      --the family's `to_ours` applied to an index array--> where each weight goes in our layout
      --> QuantizedWeight: integers rearranged (int4 packed in pairs along the grouped input
          axis), each group's scale / zero point / offset taken from the group it came from

A family's checkpoint spec turns a float tensor into our layout with `to_ours` (transposes,
reshapes, llama.cpp's rotary row order undone). Applied to the flat index of every weight, it
says where each weight lands; that is a valid quantized layout when every run of `group` weights
along our grouped input axis comes from one GGUF group (so one scale serves it). When it does not
(a group straddles two heads, say), or the tensor is float or of a type not decoded here, the
loader dequantizes that tensor as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from jax.typing import DTypeLike

from jaxinfer.quant import gguf_blocks
from jaxinfer.quant.weights import QuantizedWeight, pack_int4

if TYPE_CHECKING:
    from checkpoints import GGUFCheckpoint
    from jaxinfer.quant.config import StoredSpec


def repack(
    blocks: gguf_blocks.Blocks, to_ours: Callable[[np.ndarray], np.ndarray], inputs: tuple[int, ...], dtype: DTypeLike
) -> QuantizedWeight | None:
    """Blocks in the checkpoint's shape -> a QuantizedWeight in our layout (None if the layout does
    not keep GGUF's groups whole along our last input axis). `dtype`: the model's float dtype."""
    shape, group = blocks.integers.shape, blocks.group
    size = int(np.prod(shape))
    index = to_ours(np.arange(size, dtype=np.int32 if size < 2**31 else np.int64).reshape(shape))
    if not _is_permutation(index, size):
        return None
    axis = inputs[-1]
    if index.shape[axis] % group:
        return None
    runs = np.moveaxis(index // group, axis, -1)  # GGUF group of each weight, grouped axis last
    runs = runs.reshape(runs.shape[:-1] + (runs.shape[-1] // group, group))
    if not np.all(runs == runs[..., :1]):
        return None
    source = np.moveaxis(runs[..., 0], -1, axis)  # [our scale shape]: the GGUF group of each run
    take = lambda a: None if a is None else np.ascontiguousarray(a.reshape(-1)[source])  # noqa: E731
    q = blocks.integers.reshape(-1)[index]
    values = pack_int4(q, axis) if blocks.bits == 4 else np.ascontiguousarray(q.astype(np.int8))
    return QuantizedWeight(
        values,
        take(blocks.scales),
        take(blocks.zeros),
        "int4" if blocks.bits == 4 else "int8",
        inputs,
        group,
        take(blocks.offsets),
        dtype,
    )


def _is_permutation(index: np.ndarray, size: int) -> bool:
    """Whether `to_ours` only rearranged the weights (every index once, none altered)."""
    if not np.issubdtype(index.dtype, np.integer) or index.size != size:
        return False
    if size and (index.min() < 0 or index.max() >= size):
        return False
    seen = np.zeros(size, bool)
    seen[index.reshape(-1)] = True
    return bool(seen.all())


def native_weight(
    reader: GGUFCheckpoint, spec: StoredSpec, inputs: tuple[int, ...], dtype: DTypeLike
) -> QuantizedWeight | None:
    """The GGUF tensor `spec.name` as a host QuantizedWeight in our layout, or None when it stays
    float (a float tensor, a type not decoded here, or a layout that splits its groups)."""
    kind = reader.quant_type(spec.name)
    if kind not in gguf_blocks.SUPPORTED:
        return None
    blocks = gguf_blocks.decode(kind, reader.raw(spec.name), reader.shape(spec.name))
    return repack(blocks, spec.to_ours, inputs, dtype)
