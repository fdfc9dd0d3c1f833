"""Grouped int4 and int8 weights held output-axes-first for the CPU step (as out_first_int8.py
holds per-channel int8): one request's matrix-vector product is one fused reduction that reads
each weight as a byte and applies its group's scale inside.

On XLA:CPU a matmul on grouped weights dequantizes them into a float32 copy first (4 bytes per
weight written, then read back, in every step). Held as integers [N, groups, G], one per
byte (int4's two nibbles unpacked once at load: XLA's bitwise unpacking does not fuse into the
reduction the CPU runs a few rows as, and the float arithmetic that reads two nibbles out of a
byte costs XLA:CPU more per byte than the extra byte does), the output axes flattened to N, the
contraction is

    y[m, n] = sum_g sum_j q[n, g, j] x[m, g, j] s[n, g]  +  sum_g (o[n, g] - z[n, g] s[n, g]) X[m, g]

for w = (q - z) * s + o (zero points and offsets each optional; X[m, g] the group's sum of
inputs). At one row over 30 SmolLM2-sized matrices: int8 g32 16-17 ms against 74 for the
dequantized weight's dot and 10-11 for the float32 dot; int4 g32 with offsets 20-21 ms against
21-28 read as packed nibbles (the form held before), and on arrays already flat 10.8 against
19.5 (2-core x86_64, 2026-11-30, benchmarks/RESULTS.md). int4 thus holds a byte per weight on the CPU, a quarter of the
float32 model the CPU computes with; accelerators and meshes keep the stored layout
(`stored_arrays` gives it back bit-exactly: models/linear_layout.py). Rows past REDUCE_ROWS run as
the dequantized weight's dot.

    w = OutFirstGrouped.of(quantized)  # values [E, F/2] (int4) or [E, F] (int8), scales [E/G, F]
                                       #   -> t [F, E/G, G], scales [F, E/G] (F: outputs flattened)
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
    """What an OutFirstGrouped stands for: its QuantizedWeight's static fields and shapes."""

    method: str
    inputs: tuple[int, ...]
    group: int
    dtype: Any
    activations: Any
    shape: tuple[int, ...]  # the weight's ([in..., out...] for a linear layer's)
    scales_shape: tuple[int, ...]

    def order(self) -> tuple[int, ...]:
        """The weight's axes output first, then inputs (each in order)."""
        return tuple(i for i in range(len(self.shape)) if i not in self.inputs) + tuple(self.inputs)

    def out_shape(self) -> tuple[int, ...]:
        """The weight's output axes' sizes, in order."""
        return tuple(n for i, n in enumerate(self.shape) if i not in self.inputs)


class OutFirstGrouped:
    """t: integers [N, groups, G], the output axes flattened (uint8 levels 0..15 for int4, int8
    for int8); scales, zeros, offsets: [N, groups] (zeros and offsets optional); `stands_for` the
    QuantizedWeight's layout. Flat, because a reshape of the weight inside XLA:CPU's fused
    reduction takes it off its fast path (SmolLM2's tied LM head: 54 ms against 4.6)."""

    def __init__(self, t: Any, scales: Any, zeros: Any, offsets: Any, stands_for: StoredLayout):
        self.t, self.scales, self.zeros, self.offsets = t, scales, zeros, offsets
        self.stands_for = stands_for

    @classmethod
    def of(cls, w: Any) -> OutFirstGrouped:
        """A QuantizedWeight that is `convertible` (for one whose inputs are its trailing axes,
        as a tied LM head's embedding, only a reshape: `reads_in_place`)."""
        layout = StoredLayout(w.method, w.inputs, w.group, w.dtype, w.activations, w.shape, tuple(w.scales.shape))
        order = layout.order()
        k = math.prod(w.shape[i] for i in w.inputs)
        groups = k // (w.group or k)
        n = math.prod(layout.out_shape())
        q = unpack_int4(w.values, w.axis) if w.method == "int4" else w.values
        t = jnp.transpose(q, order).reshape(n, groups, k // groups)

        def grouped(a: Any) -> Any:  # the scales' shape -> [N, groups]
            return None if a is None else jnp.transpose(a, order).reshape(n, groups)

        return cls(t, grouped(w.scales), grouped(w.zeros), grouped(w.offsets), layout)

    @staticmethod
    def convertible(w: Any) -> bool:
        """int4 (grouped or per channel) or grouped int8 whose groups run along its flattened
        inputs, its input axes leading or trailing in order (not an expert stack's [experts, in,
        out], whose einsum shares an axis), without act-order or quantized activations."""
        n_in, rank = len(w.inputs), len(w.shape)
        k = math.prod(w.shape[i] for i in w.inputs)
        return (
            (w.method == "int4" or (w.method == "int8" and w.group > 0))
            and w.perm is None
            and w.activations is None
            and w.inputs in (tuple(range(n_in)), tuple(range(rank - n_in, rank)))
            and k % (w.group or k) == 0
        )

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the weight it stands for, in its stored axes' order."""
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

    def stored_arrays(self) -> tuple[Any, Any, Any, Any]:
        """The QuantizedWeight's (values, scales, zeros, offsets) in its axes' order, int4
        values packed along the last input."""
        layout = self.stands_for
        order = layout.order()
        inverse = tuple(int(i) for i in np.argsort(order))
        q = jnp.transpose(self.t.reshape(tuple(layout.shape[i] for i in order)), inverse)
        values = pack_int4(q, layout.inputs[-1]) if layout.method == "int4" else q

        def back(a: Any) -> Any:  # [N, groups] -> the scales' shape
            ordered = tuple(layout.scales_shape[i] for i in order)
            return None if a is None else jnp.transpose(a.reshape(ordered), inverse)

        return values, back(self.scales), back(self.zeros), back(self.offsets)

    def __repr__(self) -> str:
        layout = self.stands_for
        group = layout.group or "channel"
        return f"OutFirstGrouped({layout.method} g{group}, shape={self.shape}, inputs={self.inputs})"


_FIELDS = ("t", "scales", "zeros", "offsets")


def _unflatten(aux: StoredLayout, children: Any) -> OutFirstGrouped:
    t, scales, zeros, offsets = children
    return OutFirstGrouped(t, scales, zeros, offsets, aux)


jax.tree_util.register_pytree_with_keys(
    OutFirstGrouped,
    lambda w: ([(jax.tree_util.GetAttrKey(f), getattr(w, f)) for f in _FIELDS], w.stands_for),
    _unflatten,
    lambda w: (tuple(getattr(w, f) for f in _FIELDS), w.stands_for),
)


def reads_in_place(w: Any, x: jax.Array) -> bool:
    """Whether a QuantizedWeight on the CPU contracts as the fused reduction where it is stored:
    convertible, its inputs its trailing axes (held out-first already, as a tied LM head's
    embedding), and x a few rows."""
    n_in = len(w.inputs)
    trailing = tuple(range(len(w.shape) - n_in, len(w.shape)))
    rows = x.size // max(1, math.prod(w.shape[i] for i in w.inputs))
    return (
        jax.default_backend() == "cpu"
        and w.inputs == trailing
        and rows <= REDUCE_ROWS
        and OutFirstGrouped.convertible(w)
    )


def einsum(spec: str, x: jax.Array, w: OutFirstGrouped) -> jax.Array:
    """jnp.einsum(spec, x, w's weight) for the linear layers' specs (x's contracted axes last, the
    output x's other axes then w's), computed in float32 (at least) and cast to x's dtype."""
    layout = w.stands_for
    free = x.shape[: x.ndim - len(layout.inputs)]
    n, groups, group = w.t.shape
    compute = jnp.promote_types(jnp.promote_types(x.dtype, w.scales.dtype), jnp.float32)
    rows = x.reshape(-1, groups, group).astype(compute)  # [M, groups, G]
    scales = w.scales.astype(compute)
    q = w.t.astype(compute)
    if rows.shape[0] <= REDUCE_ROWS:
        y = jnp.sum(q[None] * rows[:, None] * scales[None, :, :, None], axis=(-2, -1))  # [M, N]
    else:
        weight = (q * scales[..., None]).reshape(n, -1)
        y = jax.lax.dot_general(rows.reshape(rows.shape[0], -1), weight, (((1,), (1,)), ((), ())))
    shift = None if w.offsets is None else w.offsets.astype(compute)
    if w.zeros is not None:
        zs = -w.zeros.astype(compute) * scales
        shift = zs if shift is None else shift + zs
    if shift is not None:
        y = y + jnp.einsum("mg,ng->mn", rows.sum(axis=-1), shift)
    return y.astype(x.dtype).reshape(*free, *layout.out_shape())
