"""Host-side quantizers of float weights (numpy, before placement): symmetric int8 per output
channel or per group, int4 per group with float offsets (packed by nibbles.py). The layouts are
QuantizedWeight's (weights.py)."""

from __future__ import annotations

import numpy as np
from jax.typing import DTypeLike

from jaxinfer.quant.nibbles import pack_int4
from jaxinfer.quant.weights import QuantizedWeight

INT4_LEVELS = 15


def quantize_int8(
    w: np.ndarray, inputs: tuple[int, ...], scale_dtype: DTypeLike, group: int = 0, name: str = "weight"
) -> QuantizedWeight:
    """Symmetric: the largest |w| maps to 127, per output channel (group 0: over all input axes)
    or per group of `group` consecutive inputs along the last input axis."""
    w32 = np.asarray(w, np.float32)
    if not group:
        amax = np.max(np.abs(w32), axis=inputs, keepdims=True)
        scales = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
        values = np.clip(np.rint(w32 / scales), -127, 127).astype(np.int8)
        return QuantizedWeight(values, scales.astype(scale_dtype), None, "int8", inputs)
    grouped, axis = _grouped(w32, inputs, group, name)
    amax = np.max(np.abs(grouped), axis=axis + 1, keepdims=True)
    scales = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    values = np.clip(np.rint(grouped / scales), -127, 127).astype(np.int8).reshape(w32.shape)
    return QuantizedWeight(values, np.squeeze(scales, axis + 1).astype(scale_dtype), None, "int8", inputs, group)


def _grouped(w32: np.ndarray, inputs: tuple[int, ...], group: int, name: str) -> tuple[np.ndarray, int]:
    """w with its last input axis split into (n / group, group), and that axis."""
    axis, n = inputs[-1], w32.shape[inputs[-1]]
    if n % group:
        raise ValueError(
            f"quantization_group_size={group} does not divide the input dimension {n} "
            f"of {name} {tuple(w32.shape)}; choose a group size that divides it"
        )
    return w32.reshape(w32.shape[:axis] + (n // group, group) + w32.shape[axis + 1 :]), axis


def quantize_int4(
    w: np.ndarray, inputs: tuple[int, ...], group: int, scale_dtype: DTypeLike, name: str = "weight"
) -> QuantizedWeight:
    """Groups of `group` inputs along the last input axis, each mapped onto 0..15 by its own min
    and max: w ~ q * s + o with o the group's minimum (a float offset, so a group of one sign
    keeps all 16 levels inside its range; an integer zero point would have to reach 0)."""
    w32 = np.asarray(w, np.float32)
    grouped, axis = _grouped(w32, inputs, group, name)
    lo = grouped.min(axis=axis + 1, keepdims=True)
    hi = grouped.max(axis=axis + 1, keepdims=True)
    scales = np.where(hi > lo, (hi - lo) / INT4_LEVELS, 1.0).astype(np.float32)
    q = np.clip(np.rint((grouped - lo) / scales), 0, INT4_LEVELS).astype(np.uint8).reshape(w32.shape)
    values = pack_int4(q, axis)
    return QuantizedWeight(
        values,
        np.squeeze(scales, axis + 1).astype(scale_dtype),
        None,
        "int4",
        inputs,
        group,
        offsets=np.squeeze(lo, axis + 1).astype(scale_dtype),
    )


def unpack_words(packed: np.ndarray, bits: int) -> np.ndarray:
    """i32 [.., w] of 32 / bits values each (4 or 8 bits, low bits first, as compressed-tensors,
    GPTQ and AWQ pack them) -> uint8 [.., w, 32 / bits]."""
    raw = np.ascontiguousarray(np.asarray(packed).astype("<i4")).view(np.uint8).reshape(*packed.shape, 4)
    if bits == 8:
        return raw
    return np.stack([raw & 0xF, raw >> 4], axis=-1).reshape(*packed.shape, 8)
