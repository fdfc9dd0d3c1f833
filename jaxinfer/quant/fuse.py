"""Fusing weights that one matmul reads together (q|k|v, gate|up) when some are quantized.

`fuse(fn, *weights)` is `fn` over the weights' arrays (`jax.tree.map`), which needs every weight
in one layout. Weights of one quantization share it; a GGUF file may not (llama.cpp's Q4_K_M
stores V as Q6_K beside Q4_K queries and keys, Gemma's as Q8_0 beside Q5_0), so differing
layouts are first brought to a common one that every member is exactly representable in:

    int8 integers (int4 unpacked; integer zero points subtracted into them: (q - z) * s keeps
    its value as (q - z) * s), the smallest group (coarser scales repeated over the finer
    groups), the wider scale dtype, and offsets (zero for members without) if any member has.

Every float the common layout computes is the one the member's own layout computed, so GGUF
weights stay bit-exact against gguf's dequantizer. A float weight beside quantized ones makes
the fused weight float (the quantized members dequantized to its dtype).

`stack` and `unstack` put weights along a new axis and take them apart again (a mixture's
experts, [X, ...]): a quantized weight's arrays alike, its input axes renumbered.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.quant.weights import QuantizedWeight, dequantize, integers, per_weight

Weight = jax.Array | QuantizedWeight  # a float weight, or a quantized one


def fuse(fn: Callable[..., jax.Array], *weights: Weight) -> Weight:
    """fn(*arrays) for each component of the weights (plain arrays: fn(*weights))."""
    quantized = [w for w in weights if isinstance(w, QuantizedWeight)]
    if not quantized:
        return fn(*weights)
    if len(quantized) < len(weights):
        dtype = next(w.dtype for w in weights if not isinstance(w, QuantizedWeight))
        return fn(*(dequantize(w, dtype) for w in weights))
    as_float = lambda: fn(*(dequantize(w) for w in weights))  # noqa: E731
    if any(w.perm is not None for w in quantized):  # act-order: one input order for all, kept
        perm = quantized[0].perm
        if any(w.perm is None or not _same(w.perm, perm) for w in quantized):
            return as_float()  # inputs read in different orders
        out = fuse(fn, *(w.with_perm(None) for w in quantized))
        return out.with_perm(perm) if isinstance(out, QuantizedWeight) else as_float()
    if len({_signature(w) for w in quantized}) > 1:
        if any(w.method == "fp8" or w.activations != quantized[0].activations for w in quantized):
            return as_float()  # no common layout
        quantized = common_layout(quantized)  # every weight is quantized here: the same list
    return jax.tree.map(fn, *quantized)


def _same(a: Any, b: Any) -> bool:
    return a.size == b.size and bool(np.array_equal(np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)))


def _signature(w: QuantizedWeight) -> tuple:
    dtypes = tuple(None if a is None else a.dtype for a in (w.values, w.scales, w.zeros, w.offsets))
    return w.method, w.inputs, w.group, w.dtype, dtypes, w.activations


def common_layout(weights: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """The weights (same inputs, same model dtype) in one int8 layout, values unchanged."""
    inputs, dtype = weights[0].inputs, weights[0].dtype
    if any(w.inputs != inputs or w.dtype != dtype for w in weights):
        raise ValueError(f"cannot fuse weights of differing inputs or dtypes: {weights}")
    axis = inputs[-1]
    group = math.gcd(*(w.group or w.shape[axis] for w in weights))
    scale_dtype = jnp.result_type(*(w.scales.dtype for w in weights))
    with_offsets = any(w.offsets is not None for w in weights)
    offset_dtype = (
        jnp.result_type(*(w.offsets.dtype for w in weights if w.offsets is not None)) if with_offsets else None
    )
    out = []
    for w in weights:
        q = integers(w).astype(jnp.int16)
        if w.zeros is not None:
            q = q - per_weight(w, w.zeros).astype(jnp.int16)
        regroup = lambda a, w=w: _regroup(w, a, group)  # noqa: E731
        offsets = None
        if with_offsets:
            offsets = (
                regroup(w.offsets).astype(offset_dtype)
                if w.offsets is not None
                else jnp.zeros_like(regroup(w.scales), dtype=offset_dtype)
            )
        out.append(
            QuantizedWeight(
                q.astype(jnp.int8),
                regroup(w.scales).astype(scale_dtype),
                None,
                "int8",
                inputs,
                group,
                offsets,
                dtype,
                w.activations,
            )
        )
    return out


def _regroup(w: QuantizedWeight, array: jax.Array, group: int) -> jax.Array:
    """A scale-shaped array of `w` -> one entry per `group` inputs along the grouped axis (every
    other input axis at its full size, as grouped scales have it)."""
    shape = list(w.shape)
    shape[w.axis] //= group
    have = array.shape[w.axis]
    array = jnp.repeat(array, shape[w.axis] // have, axis=w.axis)
    return jnp.broadcast_to(array, tuple(n if i in w.inputs else array.shape[i] for i, n in enumerate(shape)))


def stack(weights: Sequence[Weight], axis: int = 0) -> Weight:
    """jnp.stack(weights, axis) of float or quantized weights (fused as `fuse` does); a quantized
    result's input axes are renumbered past the new axis. Act-order weights stack as float (a
    mixture's grouped matmuls read their inputs in one order)."""
    if any(isinstance(w, QuantizedWeight) and w.perm is not None for w in weights):
        return jnp.stack([dequantize(w) for w in weights], axis)
    out = fuse(lambda *arrays: jnp.stack(arrays, axis), *weights)
    if not isinstance(out, QuantizedWeight):
        return out
    return _relabelled(out, tuple(i + (i >= axis) for i in out.inputs))


def unstack(w: Weight) -> tuple[Weight, ...]:
    """[X, ...] -> X weights [...]: the inverse of stack along axis 0."""
    if not isinstance(w, QuantizedWeight):
        return tuple(w[i] for i in range(w.shape[0]))
    if 0 in w.inputs:
        raise ValueError(f"cannot unstack {w!r} along its input axis 0")
    inputs = tuple(i - 1 for i in w.inputs)
    return tuple(_relabelled(w.map(operator.itemgetter(i)), inputs) for i in range(w.shape[0]))


def _relabelled(w: QuantizedWeight, inputs: tuple[int, ...]) -> QuantizedWeight:
    """(Never an act-order weight: those stack as float.)"""
    return QuantizedWeight(w.values, w.scales, w.zeros, w.method, inputs, w.group, w.offsets, w.dtype, w.activations)
