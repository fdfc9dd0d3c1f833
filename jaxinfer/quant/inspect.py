"""What a parameter tree holds: its bytes, the float parameters it stands for, and its
quantized weights' layouts (what `jaxinfer info` reports)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxinfer.quant.out_first_grouped import OutFirstGrouped
from jaxinfer.quant.out_first_int8 import OutFirstInt8
from jaxinfer.quant.weights import QuantizedWeight, layout_name

PyTree = Any  # a model's parameter tree

# A quantized weight as loaded, or as the CPU step holds it (output axes first).
_QUANTIZED = (QuantizedWeight, OutFirstInt8, OutFirstGrouped)


def _is_weight(x: Any) -> bool:
    return isinstance(x, _QUANTIZED)


def _layout(w: QuantizedWeight | OutFirstInt8 | OutFirstGrouped) -> str:
    """How the weight is stored (QuantizedWeight.layout), whichever form holds it."""
    if isinstance(w, QuantizedWeight):
        return w.layout()
    if isinstance(w, OutFirstInt8):  # per-channel, nothing else
        return layout_name(w.method, 0, (), w.activations)
    extras = {"zeros": w.zeros, "offsets": w.offsets}
    return layout_name(w.method, w.group, [k for k, v in extras.items() if v is not None])


def param_bytes(params: PyTree) -> int:
    """Bytes of every parameter array (each counted once, however it is split over devices)."""
    return sum(int(x.nbytes) for x in jax.tree.leaves(params))


def param_count(params: PyTree) -> int:
    """Parameters of the float model the tree stands for (a quantized weight counts its shape)."""
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params, is_leaf=_is_weight))


def quantization_of(params: PyTree) -> str | None:
    """ "int8", "int4", "mixed" (GGUF blocks of several layouts) or None: how the tree's quantized
    weights store their integers."""
    methods = {x.method for x in jax.tree.leaves(params, is_leaf=_is_weight) if _is_weight(x)}
    return None if not methods else methods.pop() if len(methods) == 1 else "mixed"


def quantized_tensors(params: PyTree) -> dict[str, dict[str, int]]:
    """{field: {layout: how many}} of the tree's quantized weights, e.g. {"w_qkv": {"int4 g32
    +offsets": 30}, "embed": {"int8 g32": 1}} (a field repeats once per layer)."""
    found: dict[str, dict[str, int]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_weight)[0]:
        if _is_weight(leaf):
            field = next((k.name for k in reversed(path) if isinstance(k, jax.tree_util.GetAttrKey)), str(path))
            counts = found.setdefault(field, {})
            counts[_layout(leaf)] = counts.get(_layout(leaf), 0) + 1
    return found
