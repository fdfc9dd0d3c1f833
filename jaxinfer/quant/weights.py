"""Weight-only quantized linear weights: the pytree, host-side quantizers, and the in-jit einsum.

    int8: symmetric, one scale per output channel: w ~ q * s, q in [-127, 127].
    int4: asymmetric, one scale and one integer zero point per group of `group` consecutive
          inputs (along the weight's last input axis) and output channel: w ~ (q - z) * s,
          q in [0, 15]; two q per byte (uint8), the even input index in the low nibble.

Weights keep our layout [in axes..., out axes...] and `inputs` says which axes are inputs (the
contracted ones). Scales and zero points keep the weight's rank: size 1 on the axes they do not
vary over (int8: every input axis), the group count on the grouped axis (int4). So they share
their weight's logical axis names and split over a mesh like it, and fusing q|k|v or gate|up
along output axes is the same concatenation on every array (`jax.tree.map`).

A QuantizedWeight's arrays sit in the tree under index keys, not names: a sharding rule, which
looks up the nearest name on a leaf's path, finds the field the weight fills (e.g. "w_qkv").

`einsum` is the one matmul every linear layer calls. Plain arrays pass straight to jnp.einsum;
int8 runs the dot on the integers converted to the activation dtype and scales its output
columns; int4 is dequantized first (its scales vary along the contraction). Inside the jitted step
XLA fuses the conversion into the dot's operand on GPU/TPU; the weights stay quantized in memory.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

INT4_LEVELS = 15


class QuantizedWeight:
    """values (int8, or uint8 holding two int4), scales, zeros (int4 only) + static layout."""

    def __init__(self, values, scales, zeros, method: str, inputs: tuple[int, ...], group: int = 0):
        self.values, self.scales, self.zeros = values, scales, zeros
        self.method, self.inputs, self.group = method, tuple(inputs), group

    @property
    def axis(self) -> int:
        """The grouped (and, for int4, packed) input axis."""
        return self.inputs[-1]

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the float weight it stands for."""
        shape = list(self.values.shape)
        if self.method == "int4":
            shape[self.axis] *= 2
        return tuple(shape)

    def arrays(self) -> dict[str, jax.Array | np.ndarray]:
        """Its arrays by component name (how a checkpoint stores them)."""
        named = {"values": self.values, "scales": self.scales}
        return named if self.zeros is None else {**named, "zeros": self.zeros}

    def map(self, fn) -> "QuantizedWeight":
        """fn applied to each array (e.g. placing each on its devices)."""
        zeros = None if self.zeros is None else fn(self.zeros)
        return QuantizedWeight(fn(self.values), fn(self.scales), zeros, self.method, self.inputs, self.group)

    def __repr__(self) -> str:
        return f"QuantizedWeight({self.method}, shape={self.shape}, inputs={self.inputs}, group={self.group})"


def _flatten_with_keys(w: QuantizedWeight):
    children = (w.values, w.scales, w.zeros)
    keys = [jax.tree_util.FlattenedIndexKey(i) for i in range(3)]
    return list(zip(keys, children)), (w.method, w.inputs, w.group)


def _unflatten(aux, children) -> QuantizedWeight:
    return QuantizedWeight(*children, *aux)


jax.tree_util.register_pytree_with_keys(
    QuantizedWeight, _flatten_with_keys, _unflatten,
    lambda w: ((w.values, w.scales, w.zeros), (w.method, w.inputs, w.group)))


def quantize_int8(w: np.ndarray, inputs: tuple[int, ...], scale_dtype) -> QuantizedWeight:
    """Per output channel: the largest |w| over the input axes maps to 127."""
    w32 = np.asarray(w, np.float32)
    amax = np.max(np.abs(w32), axis=inputs, keepdims=True)
    scales = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    values = np.clip(np.rint(w32 / scales), -127, 127).astype(np.int8)
    return QuantizedWeight(values, scales.astype(scale_dtype), None, "int8", inputs)


def quantize_int4(w: np.ndarray, inputs: tuple[int, ...], group: int, scale_dtype,
                  name: str = "weight") -> QuantizedWeight:
    """Groups of `group` inputs along the last input axis, each mapped onto 0..15 by its min/max."""
    w32 = np.asarray(w, np.float32)
    axis, n = inputs[-1], w32.shape[inputs[-1]]
    if n % group:
        raise ValueError(f"quantization_group_size={group} does not divide the input dimension {n} "
                         f"of {name} {tuple(w32.shape)}; choose a group size that divides it")
    grouped = w32.reshape(w32.shape[:axis] + (n // group, group) + w32.shape[axis + 1:])
    lo = np.minimum(grouped.min(axis=axis + 1, keepdims=True), 0.0)
    hi = np.maximum(grouped.max(axis=axis + 1, keepdims=True), 0.0)
    scales = np.where(hi > lo, (hi - lo) / INT4_LEVELS, 1.0).astype(np.float32)
    zeros = np.clip(np.rint(-lo / scales), 0, INT4_LEVELS)
    q = np.clip(np.rint(grouped / scales) + zeros, 0, INT4_LEVELS).astype(np.uint8).reshape(w32.shape)
    even, odd = np.split(np.moveaxis(q, axis, 0).reshape(n // 2, 2, -1), 2, axis=1)
    packed = (even | (odd << 4)).reshape((n // 2,) + tuple(np.delete(w32.shape, axis)))
    values = np.ascontiguousarray(np.moveaxis(packed, 0, axis))
    return QuantizedWeight(values, np.squeeze(scales, axis + 1).astype(scale_dtype),
                           np.squeeze(zeros, axis + 1).astype(scale_dtype), "int4", inputs, group)


def unpack_int4(values: jax.Array, axis: int) -> jax.Array:
    """uint8 [.., n/2, ..] -> uint8 [.., n, ..] (low nibble first)."""
    pairs = jnp.stack([values & 0xF, values >> 4], axis=axis + 1)  # [.., n/2, 2, ..]
    shape = list(values.shape)
    shape[axis] *= 2
    return pairs.reshape(shape)


def dequantize(w: QuantizedWeight | jax.Array, dtype) -> jax.Array:
    """The float weight (in `dtype`) a QuantizedWeight stands for; plain arrays pass through."""
    if not isinstance(w, QuantizedWeight):
        return w
    if w.method == "int8":
        return w.values.astype(dtype) * w.scales.astype(dtype)
    axis, shape = w.axis, w.shape
    q = unpack_int4(w.values, axis).astype(dtype)
    grouped = q.reshape(shape[:axis] + (shape[axis] // w.group, w.group) + shape[axis + 1:])
    scales = jnp.expand_dims(w.scales.astype(dtype), axis + 1)
    zeros = jnp.expand_dims(w.zeros.astype(dtype), axis + 1)
    return ((grouped - zeros) * scales).reshape(shape)


def einsum(spec: str, x: jax.Array, w: QuantizedWeight | jax.Array) -> jax.Array:
    """jnp.einsum(spec, x, w) for a float or quantized weight `w` (the linear layers' matmul)."""
    if not isinstance(w, QuantizedWeight):
        return jnp.einsum(spec, x, w)
    if w.method != "int8":
        return jnp.einsum(spec, x, dequantize(w, x.dtype))
    operands, out = spec.split("->")
    w_letters = operands.split(",")[1]
    y = jnp.einsum(spec, x, w.values.astype(x.dtype))
    w_out = "".join(c for i, c in enumerate(w_letters) if i not in w.inputs)
    scales = jnp.squeeze(w.scales, w.inputs).astype(y.dtype)  # [out axes]
    return jnp.einsum(f"{out},{w_out}->{out}", y, scales)
