"""Per-channel int8 / fp8 weights held output-axes-first for the CPU step (as out_first.py holds
float32 ones): the integers read as one streaming reduction, converted inside it.

On XLA:CPU a matmul on int8 weights converts them to float first (a float32 copy of the weight
written and read back every step), and the product-and-sum form over [in..., out...] strides
across rows. With the integers [out..., in...] the contraction is one reduction along contiguous
rows that reads each weight once as a byte: SmolLM2's [576, 3072] up|gate at one row, 0.29 ms
against 1.04 ms for the converted dot and 0.46 ms for the float32 weight's dot (2-core x86_64,
2026-11-29, benchmarks/RESULTS.md). Rows past CPU_REDUCE_ROWS' top run as the dot.

    w = OutFirstInt8.of(quantized)     # values [E, F] int8, scales [1, F] -> t [F, E], scales [F]
    einsum(spec, x, w)                 # (quant.einsum) the spec of the original weight

Float8 (e4m3) values are held as bfloat16, which represents each exactly: XLA:CPU converts
float8 outside its fused reductions, ~10x slower than int8 over 30 SmolLM2-sized matrices (85 ms
against 8; bfloat16 12 ms, the float32 dot 13). `stored_arrays` gives back the [in..., out...]
values and scales, float8 again (models/linear_layout.py rebuilds the QuantizedWeight where a mesh
computes).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.quant.activations import fake_quantized
from jaxinfer.quant.out_first import CPU_REDUCE_ROWS


class OutFirstInt8:
    """t: the integers (or float8 values) output axes first; scales: one per output channel."""

    def __init__(self, t: Any, scales: Any, inputs: tuple[int, ...], method: str, dtype: Any, activations: Any):
        self.t, self.scales, self.inputs = t, scales, tuple(inputs)
        self.method, self.dtype, self.activations = method, np.dtype(dtype), activations

    @classmethod
    def of(cls, w: Any) -> OutFirstInt8:
        """A per-channel int8 / fp8 QuantizedWeight (per_channel_int8, no act-order)."""
        outputs = tuple(i for i in range(w.values.ndim) if i not in w.inputs)
        t = jnp.transpose(w.values, outputs + w.inputs)
        if w.method == "fp8":  # every e4m3 value is a bfloat16 (3 mantissa bits of 7), read ~7x faster
            t = t.astype(jnp.bfloat16)
        return cls(t, jnp.squeeze(w.scales, w.inputs), w.inputs, w.method, w.dtype, w.activations)

    def _order(self) -> list[int]:
        """The axes of `t` in the original [in..., out...] order."""
        n_out = self.t.ndim - len(self.inputs)
        outputs = [i for i in range(self.t.ndim) if i not in self.inputs]
        return [n_out + self.inputs.index(i) if i in self.inputs else outputs.index(i) for i in range(self.t.ndim)]

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the [in..., out...] weight it stands for."""
        return tuple(self.t.shape[axis] for axis in self._order())

    def devices(self) -> set[jax.Device]:
        return self.t.devices()

    def stored_arrays(self) -> tuple[jax.Array, jax.Array]:
        """(values [in..., out...], scales of the weight's rank, size 1 on the inputs)."""
        values = jnp.transpose(self.t, self._order())
        values = values.astype(jnp.float8_e4m3fn) if self.method == "fp8" else values
        return values, jnp.expand_dims(self.scales, self.inputs)

    def __repr__(self) -> str:
        return f"OutFirstInt8({self.method}, shape={self.shape}, inputs={self.inputs})"


def _unflatten(aux: tuple[Any, ...], children: Any) -> OutFirstInt8:
    t, scales = children
    inputs, method, dtype, activations = aux
    return OutFirstInt8(t, scales, inputs, method, dtype, activations)


jax.tree_util.register_pytree_with_keys(
    OutFirstInt8,
    lambda w: (
        [(jax.tree_util.GetAttrKey("t"), w.t), (jax.tree_util.GetAttrKey("scales"), w.scales)],
        (w.inputs, w.method, w.dtype, w.activations),
    ),
    _unflatten,
    lambda w: ((w.t, w.scales), (w.inputs, w.method, w.dtype, w.activations)),
)


def einsum(spec: str, x: jax.Array, w: OutFirstInt8) -> jax.Array:
    """jnp.einsum(spec, x, w's weight) for the linear layers' specs (x's contracted axes last, the
    output x's other axes then w's): a reduction over the integers for few rows, else the dot."""
    if w.activations is not None:
        x = fake_quantized(spec, x, w.activations)
    n_in = len(w.inputs)
    free = x.shape[: x.ndim - n_in]
    k = math.prod(x.shape[x.ndim - n_in :])
    t = w.t.reshape(-1, k)  # [N, K]
    rows = x.reshape(-1, k)
    if rows.shape[0] <= CPU_REDUCE_ROWS[1]:
        y = jnp.sum(t[None].astype(x.dtype) * rows[:, None, :], axis=-1)  # [M, N], one pass over t
    else:
        y = jax.lax.dot_general(rows, t.astype(x.dtype), (((1,), (1,)), ((), ())))
    y = y * w.scales.reshape(-1).astype(y.dtype)
    return y.reshape(*free, *w.t.shape[: w.t.ndim - n_in])
