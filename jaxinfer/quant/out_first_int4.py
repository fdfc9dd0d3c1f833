"""Grouped int4 weights held output-axes-first for the CPU step (as out_first_int8.py holds
per-channel int8): one request's matrix-vector product reads each weight as half a byte.

On XLA:CPU a matmul on int4 weights dequantizes them into a float32 copy first (8 times the
bytes written, then read back), and XLA's bitwise unpacking does not fuse into the reduction the
CPU runs a few rows as. Here each group of G inputs is one run of G/2 bytes, input j of the group
in the low nibble of byte j and input G/2 + j in its high nibble; a byte b holds lo + 16 hi, so

    lo * x_lo + hi * x_hi = b * x_lo + floor(b / 16) * (x_hi - 16 x_lo)

and the whole contraction is one fused reduction of float arithmetic over the bytes:

    y[n] = sum_g s[n, g] * sum_j (b x_lo + floor(b / 16) (x_hi - 16 x_lo))[n, g, j]
           + sum_g (o[n, g] - z[n, g] s[n, g]) * X[g]        (X[g]: the group's sum of inputs)

for w = (q - z) * s + o (zero points and offsets each optional). SmolLM2's 30 layers of linears
at one row: 30 ms, against 19 for the float32 model's and about three times as long for the
dequantized weight's dot (2-core x86_64, 2026-11-30): XLA:CPU's fused reduction is bound by its
elementwise steps here, not by the bytes. At two rows it still pays; from three on the weight is
dequantized and dotted (the fused reduction leaves its fast path with more rows).

    w = OutFirstInt4.of(quantized)     # values [E, F/2.. packed], scales [E/G, F] -> t [F, E/G, G/2]
    einsum(spec, x, w)                 # (quant.einsum) the spec of the original weight
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.quant.nibbles import pack_int4, unpack_int4

# Rows (tokens) up to this run as the fused reduction, more as the dequantized weight's dot.
REDUCE_ROWS = 2


class StoredLayout(NamedTuple):
    """What an OutFirstInt4 stands for: its QuantizedWeight's static fields and shapes."""

    method: str
    inputs: tuple[int, ...]
    group: int
    dtype: Any
    activations: Any
    shape: tuple[int, ...]  # the weight's, [in..., out...]
    scales_shape: tuple[int, ...]


class OutFirstInt4:
    """t: uint8 [out..., groups, G/2] (two inputs per byte, see above); scales, zeros, offsets:
    [out..., groups] (zeros and offsets optional); `stands_for` the QuantizedWeight's layout."""

    def __init__(self, t: Any, scales: Any, zeros: Any, offsets: Any, stands_for: StoredLayout):
        self.t, self.scales, self.zeros, self.offsets = t, scales, zeros, offsets
        self.stands_for = stands_for

    @classmethod
    def of(cls, w: Any) -> OutFirstInt4:
        """A grouped (or per-channel) int4 QuantizedWeight whose inputs lead its axes in order,
        without act-order or quantized activations (`convertible`)."""
        n_in = len(w.inputs)
        shape = w.shape
        out_shape, k = shape[n_in:], math.prod(shape[:n_in])
        group = w.group or k
        q = jnp.moveaxis(unpack_int4(w.values, n_in - 1).reshape(k, -1), 0, -1)  # [N, K]
        halves = q.reshape(-1, k // group, 2, group // 2)
        t = (halves[:, :, 0] | (halves[:, :, 1] << 4)).astype(jnp.uint8).reshape(*out_shape, k // group, group // 2)

        def grouped(a: Any) -> Any:  # [in' ..., out...] -> [out..., groups]
            return None if a is None else jnp.moveaxis(a.reshape(-1, *out_shape), 0, -1)

        stands_for = StoredLayout(w.method, w.inputs, w.group, w.dtype, w.activations, shape, tuple(w.scales.shape))
        return cls(t, grouped(w.scales), grouped(w.zeros), grouped(w.offsets), stands_for)

    @staticmethod
    def convertible(w: Any) -> bool:
        """int4 whose groups run along its flattened inputs (inputs leading, in order), whose
        group holds an even number of inputs, without act-order or quantized activations."""
        n_in = len(w.inputs)
        k = math.prod(w.shape[:n_in])
        group = w.group or k
        return (
            w.method == "int4"
            and w.perm is None
            and w.activations is None
            and w.inputs == tuple(range(n_in))
            and group % 2 == 0
            and k % group == 0
        )

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the [in..., out...] weight it stands for."""
        return tuple(self.stands_for.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.stands_for.dtype)

    @property
    def inputs(self) -> tuple[int, ...]:
        return tuple(self.stands_for.inputs)

    @property
    def method(self) -> str:
        return str(self.stands_for.method)

    @property
    def group(self) -> int:
        return int(self.stands_for.group)

    def devices(self) -> set[jax.Device]:
        return self.t.devices()

    def integers(self) -> jax.Array:
        """q [N, K] uint8, inputs flattened in order."""
        n = math.prod(self.t.shape[:-2])
        lo, hi = self.t & 0xF, self.t >> 4
        return jnp.stack([lo, hi], axis=-2).reshape(n, -1)

    def stored_arrays(self) -> tuple[Any, Any, Any, Any]:
        """The QuantizedWeight's (values, scales, zeros, offsets): [in..., out...], the values
        packed along the last input."""
        layout = self.stands_for
        q = jnp.moveaxis(self.integers(), -1, 0).reshape(layout.shape)
        values = pack_int4(q, len(layout.inputs) - 1)

        def back(a: Any) -> Any:  # [out..., groups] -> the scales' shape
            return None if a is None else jnp.moveaxis(a.reshape(-1, a.shape[-1]), -1, 0).reshape(layout.scales_shape)

        return values, back(self.scales), back(self.zeros), back(self.offsets)

    def __repr__(self) -> str:
        return f"OutFirstInt4(g{self.stands_for.group or 'channel'}, shape={self.shape}, inputs={self.inputs})"


_FIELDS = ("t", "scales", "zeros", "offsets")


def _unflatten(aux: StoredLayout, children: Any) -> OutFirstInt4:
    t, scales, zeros, offsets = children
    return OutFirstInt4(t, scales, zeros, offsets, aux)


jax.tree_util.register_pytree_with_keys(
    OutFirstInt4,
    lambda w: ([(jax.tree_util.GetAttrKey(f), getattr(w, f)) for f in _FIELDS], w.stands_for),
    _unflatten,
    lambda w: (tuple(getattr(w, f) for f in _FIELDS), w.stands_for),
)


def einsum(spec: str, x: jax.Array, w: OutFirstInt4) -> jax.Array:
    """jnp.einsum(spec, x, w's weight) for the linear layers' specs (x's contracted axes last, the
    output x's other axes then w's), computed in float32 (at least) and cast to x's dtype."""
    n_in = len(w.inputs)
    free = x.shape[: x.ndim - n_in]
    out_shape = w.t.shape[:-2]
    n, (groups, half) = math.prod(out_shape), w.t.shape[-2:]
    compute = jnp.promote_types(jnp.promote_types(x.dtype, w.scales.dtype), jnp.float32)
    rows = x.reshape(-1, groups, 2, half).astype(compute)  # [M, groups, 2, G/2]
    scales = w.scales.reshape(n, groups).astype(compute)
    if rows.shape[0] <= REDUCE_ROWS:
        b = w.t.reshape(n, groups, half).astype(compute)[None]  # [1, N, groups, G/2]
        x_lo, x_hi = rows[:, None, :, 0], rows[:, None, :, 1]
        # 1/16 as a value XLA cannot fold: a constant's broadcast is written out weight-sized for
        # the fused reduction to read (XLA:CPU fuses broadcasts of parameters, not of constants).
        sixteenth = jax.lax.optimization_barrier(jnp.asarray(1 / 16, compute))
        terms = b * x_lo + jnp.floor(b * sixteenth) * (x_hi - 16 * x_lo)
        y = jnp.sum(terms * scales[None, :, :, None], axis=(-2, -1))  # [M, N]
    else:
        q = w.integers().reshape(n, groups, 2 * half).astype(compute)
        weight = (q * scales[..., None]).reshape(n, -1)
        y = jax.lax.dot_general(rows.reshape(rows.shape[0], -1), weight, (((1,), (1,)), ((), ())))
    shift = None if w.offsets is None else w.offsets.reshape(n, groups).astype(compute)
    if w.zeros is not None:
        zs = -w.zeros.reshape(n, groups).astype(compute) * scales
        shift = zs if shift is None else shift + zs
    if shift is not None:
        y = y + jnp.einsum("mg,ng->mn", rows.sum(axis=(2, 3)), shift)
    return y.astype(x.dtype).reshape(*free, *out_shape)
