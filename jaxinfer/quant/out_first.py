"""Float linear weights held output-axes-first, the layout the CPU step computes small batches in.

XLA:CPU's matrix-product kernels repack the streamed operand on every call when it is not a
single row, so a decode step of a few rows reads each weight about three times. Written as a
product and a sum over the contracted axes, with the weight laid out [out axes..., in axes...]
and the result [N, M] (transposed after), the same contraction is one streaming reduction. For
SmolLM2-sized [576, 3072] weights streamed from memory: 0.41 against 0.69 ms at 8 rows, 0.56
against 0.96 at 16, 0.89 against 1.39 at 32 (benchmarks/RESULTS.md, 2026-11-24); one row stays a
dot (the matrix-vector kernel already streams at full rate), and so do larger row counts.

    w = OutFirstWeight.of(w_in_first, inputs=(0,))      # [E, 2, F] -> stored [2, F, E]
    einsum("te,ecf->tcf", x, w)                         # (quant.einsum) the spec of the original

The worker converts a model's float32 linear weights on one CPU device without a mesh
(`to_out_first`); everywhere else weights keep their [in..., out...] layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

# Rows (tokens) between these use the product-and-sum form on the CPU.
CPU_REDUCE_ROWS = (2, 32)


class OutFirstWeight:
    """t: the weight with its output axes first, then its input axes in their original order."""

    def __init__(self, t: jax.Array, inputs: tuple[int, ...]):
        self.t, self.inputs = t, tuple(inputs)

    @classmethod
    def of(cls, w: jax.Array, inputs: tuple[int, ...]) -> OutFirstWeight:
        outputs = tuple(i for i in range(w.ndim) if i not in inputs)
        return cls(jnp.transpose(w, outputs + tuple(inputs)), inputs)

    def _order(self) -> list[int]:
        """The axes of `t` in [in..., out...] order (the permutation back to the original)."""
        n_out = self.t.ndim - len(self.inputs)
        outputs = iter(range(n_out))
        return [n_out + self.inputs.index(i) if i in self.inputs else next(outputs) for i in range(self.t.ndim)]

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the [in..., out...] weight it stands for."""
        return tuple(self.t.shape[axis] for axis in self._order())

    @property
    def dtype(self) -> np.dtype:
        return self.t.dtype

    def devices(self) -> set[jax.Device]:
        return self.t.devices()

    def stored(self) -> jax.Array:
        """Back in [in..., out...] order."""
        return jnp.transpose(self.t, self._order())

    def spec_letters(self, w_letters: str) -> str:
        """The einsum letters of `t`, given those of the original weight."""
        return "".join(c for i, c in enumerate(w_letters) if i not in self.inputs) + "".join(
            w_letters[i] for i in self.inputs
        )

    def __repr__(self) -> str:
        return f"OutFirstWeight(shape={self.shape}, inputs={self.inputs}, dtype={self.dtype})"


jax.tree_util.register_pytree_with_keys(
    OutFirstWeight,
    lambda w: ([(jax.tree_util.GetAttrKey("t"), w.t)], w.inputs),
    lambda inputs, children: OutFirstWeight(next(iter(children)), inputs),
    lambda w: ((w.t,), w.inputs),
)


def contract_rows(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] times w [N, K] contracted on K -> [M, N]: product and sum on the CPU for
    CPU_REDUCE_ROWS rows of a float32 weight (a narrower one would sum in its own precision), a
    dot otherwise."""
    low, high = CPU_REDUCE_ROWS
    if jax.default_backend() == "cpu" and low <= x.shape[0] <= high and w.dtype == jnp.float32:
        return jnp.sum(w[:, None, :] * x[None, :, :].astype(w.dtype), axis=-1).T.astype(jnp.result_type(x, w))
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())))


def to_out_first[L: DataclassInstance](layer: L, fields: Mapping[str, tuple[int, ...]]) -> L:
    """A layer (a flax struct dataclass) with each named float32 array field -> OutFirstWeight."""
    changes = {
        name: OutFirstWeight.of(getattr(layer, name), inputs)
        for name, inputs in fields.items()
        if isinstance(getattr(layer, name, None), jax.Array) and getattr(layer, name).dtype == jnp.float32
    }
    return dataclasses.replace(layer, **changes) if changes else layer
