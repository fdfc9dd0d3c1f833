"""Which quantization a model loads with, and what it does to a parameter tree and a checkpoint.

`QuantConfig` is checked where the user names it (LLM, the CLI, `jaxinfer convert`); the loader
calls `quantize_field` on each linear weight as it is read (on the host, before it is placed, so
no device ever holds the float weight). An orbax checkpoint saved quantized stores each weight's
arrays as NAME.values, NAME.scales (and NAME.zeros); `component_specs` names and shapes them so
a load restores them as saved, and its metadata carries `QuantConfig.to_metadata()`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxinfer.quant.weights import QuantizedWeight, quantize_int4, quantize_int8

METHODS = ("int8", "int4")
DEFAULT_GROUP_SIZE = 64


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    method: str  # "int8" (per output channel) or "int4" (group-wise, with zero points)
    group_size: int = DEFAULT_GROUP_SIZE  # int4 only: inputs sharing one scale and zero point

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown quantization {self.method!r}; choose one of {list(METHODS)} "
                             "(or none)")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) \
                or self.group_size < 2 or self.group_size % 2:
            raise ValueError(f"quantization_group_size={self.group_size!r}: expected an even integer "
                             ">= 2 (e.g. 32, 64 or 128)")

    @classmethod
    def parse(cls, method: str | None, group_size: int | None = None) -> "QuantConfig | None":
        """None or "none" -> None; otherwise a checked QuantConfig."""
        if method is None or method == "none":
            return None
        return cls(method, DEFAULT_GROUP_SIZE if group_size is None else group_size)

    def to_metadata(self) -> dict[str, Any]:
        return {"method": self.method, "group_size": self.group_size if self.method == "int4" else None}

    @classmethod
    def from_metadata(cls, record: Mapping[str, Any] | None) -> "QuantConfig | None":
        if not record:
            return None
        return cls(record["method"], record.get("group_size") or DEFAULT_GROUP_SIZE)


def quantize_field(array: np.ndarray, field: str, inputs: tuple[int, ...], quant: QuantConfig,
                   scale_dtype) -> QuantizedWeight:
    """One linear weight in our layout (`inputs`: its input axes) -> its host QuantizedWeight."""
    if quant.method == "int8":
        return quantize_int8(array, inputs, scale_dtype)
    return quantize_int4(array, inputs, quant.group_size, scale_dtype, name=field)


def component_shapes(shape: tuple[int, ...], inputs: tuple[int, ...], quant: QuantConfig,
                     scale_dtype) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The arrays a weight of this float shape is stored as: {component: (shape, dtype)}."""
    if quant.method == "int8":
        scales = tuple(1 if i in inputs else n for i, n in enumerate(shape))
        return {"values": (tuple(shape), np.dtype(np.int8)), "scales": (scales, np.dtype(scale_dtype))}
    axis = inputs[-1]
    values, scales = list(shape), list(shape)
    values[axis] //= 2
    scales[axis] //= quant.group_size
    return {"values": (tuple(values), np.dtype(np.uint8)), "scales": (tuple(scales), np.dtype(scale_dtype)),
            "zeros": (tuple(scales), np.dtype(scale_dtype))}


def component_specs(spec, inputs: tuple[int, ...], quant: QuantConfig, scale_dtype) -> list:
    """A checkpoint TensorSpec of a linear weight -> one spec per stored array (NAME.values, ...)."""
    shapes = component_shapes(spec.ckpt_shape, inputs, quant, scale_dtype)
    return [dataclasses.replace(spec, name=f"{spec.name}.{part}", ckpt_shape=shape)
            for part, (shape, _) in shapes.items()]


def join_components(arrays: Mapping[str, Any], name: str, inputs: tuple[int, ...],
                    quant: QuantConfig) -> QuantizedWeight:
    """The QuantizedWeight restored as NAME.values, NAME.scales (and NAME.zeros)."""
    zeros = arrays.get(f"{name}.zeros")
    return QuantizedWeight(arrays[f"{name}.values"], arrays[f"{name}.scales"], zeros, quant.method,
                           inputs, quant.group_size if quant.method == "int4" else 0)


def flat_arrays(name: str, value) -> dict[str, Any]:
    """{checkpoint name: array} of a field: itself, or a QuantizedWeight's arrays."""
    if isinstance(value, QuantizedWeight):
        return {f"{name}.{part}": array for part, array in value.arrays().items()}
    return {name: value}


def param_bytes(params) -> int:
    """Bytes of every parameter array (each counted once, however it is split over devices)."""
    return sum(int(x.nbytes) for x in jax.tree.leaves(params))


def param_count(params) -> int:
    """Parameters of the float model the tree stands for (a quantized weight counts its shape)."""
    is_weight = lambda x: isinstance(x, QuantizedWeight)  # noqa: E731
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params, is_leaf=is_weight))


def quantization_of(params) -> str | None:
    """"int8", "int4" or None: the method of the tree's quantized weights."""
    is_weight = lambda x: isinstance(x, QuantizedWeight)  # noqa: E731
    methods = {x.method for x in jax.tree.leaves(params, is_leaf=is_weight) if is_weight(x)}
    return next(iter(methods)) if methods else None
