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
from jaxinfer.quant.nibbles import pack_int4
from jaxinfer.quant.weights import QuantizedWeight

if TYPE_CHECKING:
    from checkpoints import GGUFCheckpoint
    from jaxinfer.quant.config import StoredSpec


def repack(
    blocks: gguf_blocks.Blocks, to_ours: Callable[[np.ndarray], np.ndarray], inputs: tuple[int, ...], dtype: DTypeLike
) -> QuantizedWeight | None:
    """Blocks in the checkpoint's shape -> a QuantizedWeight in our layout (None if the layout does
    not keep the groups whole along our last input axis, or along it and the one before where a
    group spans several of its rows). `dtype`: the model's float dtype."""
    shape, group = blocks.integers.shape, blocks.group
    size = int(np.prod(shape))
    index = to_ours(np.arange(size, dtype=np.int32 if size < 2**31 else np.int64).reshape(shape))
    if not is_permutation(index, size):
        return None
    axis = inputs[-1]
    n, span = index.shape[axis], 1
    if n % group:  # a group longer than our axis may span rows of the input axis before it
        if group % n or len(inputs) < 2 or inputs[-2] != axis - 1 or index.shape[axis - 1] % (group // n):
            return None
        span = group // n  # (an output projection [H, D, E] whose head_dim D is under the group)
    merged = index.reshape(index.shape[: axis - 1] + (-1,) + index.shape[axis + 1 :]) if span > 1 else index
    grouped_axis = axis - 1 if span > 1 else axis
    runs = np.moveaxis(merged // group, grouped_axis, -1)  # source group of each weight, grouped axis last
    runs = runs.reshape(runs.shape[:-1] + (runs.shape[-1] // group, group))
    if not np.all(runs == runs[..., :1]):
        return None
    source = np.moveaxis(runs[..., 0], -1, grouped_axis)  # [our scale shape]: the source group of each run
    if span > 1:
        source = np.expand_dims(source, axis)  # [.., H / span, 1, ..]
    take = lambda a: None if a is None else np.ascontiguousarray(a.reshape(-1)[source])  # noqa: E731
    q = blocks.integers.reshape(-1)[index]
    q = q.astype(np.int8) if q.dtype.kind in "iu" and blocks.bits == 8 else q  # float8 values stay
    values = pack_int4(q, axis) if blocks.bits == 4 else np.ascontiguousarray(q)
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


def is_permutation(index: np.ndarray, size: int) -> bool:
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
