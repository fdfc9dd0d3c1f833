"""The layers' linear weights in the layout the step computes with (a family's `compute_layout`):
output axes first on one CPU device without a mesh (quant/out_first.py, out_first_int8.py,
out_first_grouped.py), [in..., out...] everywhere else."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh

from jaxinfer.models.layers import DecoderParams
from jaxinfer.quant import QuantizedWeight
from jaxinfer.quant.out_first import OutFirstWeight, to_out_first
from jaxinfer.quant.out_first_grouped import OutFirstGrouped
from jaxinfer.quant.out_first_int8 import OutFirstInt8

# The float linear weights of a decoder layer, by field, with their input (contracted) axes.
LAYER_LINEARS = {"w_qkv": (0,), "wo": (0, 1), "w_gate_up": (0,), "w_down": (0,)}


def linear_layout[P: DecoderParams](params: P, mesh: Mesh | None) -> P:
    """The layers' float32 (per-channel int8 / fp8, int4) linear weights in the layout the step
    computes with: output axes first (jaxinfer/quant/out_first.py, out_first_int8/int4.py) on one CPU
    device without a mesh, where small batches run as streaming reductions; [in..., out...]
    everywhere else. Either layout converts to the other.
    (A tied LM head needs no conversion: the embedding [V, E] is already out-first.)"""
    device = next(iter(jax.tree.leaves(params)[0].devices()))
    if mesh is None and device.platform == "cpu":
        layers = (_quantized_out_first(to_out_first(layer, LAYER_LINEARS)) for layer in params.layers)
        return dataclasses.replace(params, layers=tuple(layers))
    kinds = (OutFirstWeight, OutFirstInt8, OutFirstGrouped)
    return jax.tree.map(_stored, params, is_leaf=lambda w: isinstance(w, kinds))


def _quantized_out_first(layer: Any) -> Any:
    """Per-channel int8 / fp8 and grouped int4 / int8 linear weights out-first too (quant/out_first_int8.py,
    out_first_grouped.py)."""
    changes: dict[str, Any] = {}
    for name in LAYER_LINEARS:
        if not isinstance(w := getattr(layer, name, None), QuantizedWeight):
            continue
        if w.per_channel_int8 and w.perm is None:
            changes[name] = OutFirstInt8.of(w)
        elif OutFirstGrouped.convertible(w):
            changes[name] = OutFirstGrouped.of(w)
    return dataclasses.replace(layer, **changes) if changes else layer


def _stored(w: Any) -> Any:
    if isinstance(w, OutFirstInt8):  # back to the QuantizedWeight it was
        values, scales = w.stored_arrays()
        return QuantizedWeight(values, scales, None, w.method, w.inputs, 0, None, w.dtype, w.activations)
    if isinstance(w, OutFirstGrouped):
        values, scales, zeros, offsets = w.stored_arrays()
        s = w.stands_for
        return QuantizedWeight(values, scales, zeros, s.method, s.inputs, s.group, offsets, s.dtype, s.activations)
    return w.stored() if isinstance(w, OutFirstWeight) else w
