"""What a parameter tree holds: its bytes, the float parameters it stands for, and its
quantized weights' layouts (what `jaxinfer info` reports)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxinfer.quant.weights import QuantizedWeight

PyTree = Any  # a model's parameter tree


def param_bytes(params: PyTree) -> int:
    """Bytes of every parameter array (each counted once, however it is split over devices)."""
    return sum(int(x.nbytes) for x in jax.tree.leaves(params))


def param_count(params: PyTree) -> int:
    """Parameters of the float model the tree stands for (a quantized weight counts its shape)."""
    is_weight = lambda x: isinstance(x, QuantizedWeight)  # noqa: E731
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params, is_leaf=is_weight))


def quantization_of(params: PyTree) -> str | None:
    """ "int8", "int4", "mixed" (GGUF blocks of several layouts) or None: how the tree's quantized
    weights store their integers."""
    is_weight = lambda x: isinstance(x, QuantizedWeight)  # noqa: E731
    methods = {x.method for x in jax.tree.leaves(params, is_leaf=is_weight) if is_weight(x)}
    return None if not methods else methods.pop() if len(methods) == 1 else "mixed"


def quantized_tensors(params: PyTree) -> dict[str, dict[str, int]]:
    """{field: {layout: how many}} of the tree's quantized weights, e.g. {"w_qkv": {"int4 g32
    +offsets": 30}, "embed": {"int8 g32": 1}} (a field repeats once per layer)."""
    is_weight = lambda x: isinstance(x, QuantizedWeight)  # noqa: E731
    found: dict[str, dict[str, int]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_weight)[0]:
        if is_weight(leaf):
            field = next((k.name for k in reversed(path) if isinstance(k, jax.tree_util.GetAttrKey)), str(path))
            counts = found.setdefault(field, {})
            counts[leaf.layout()] = counts.get(leaf.layout(), 0) + 1
    return found
