"""Which quantization a model loads with, and what it does to a parameter tree and a checkpoint.

`QuantConfig` is checked where the user names it (LLM, the CLI, `jaxinfer convert`); the loader
calls `quantize_field` on each linear weight as it is read (on the host, before it is placed, so
no device ever holds the float weight). An orbax checkpoint saved quantized stores each weight's
arrays as NAME.values, NAME.scales (and NAME.offsets or NAME.zeros); `component_specs` names and shapes them so
a load restores them as saved, and its metadata carries `QuantConfig.to_metadata()`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Protocol

import numpy as np
from jax.typing import DTypeLike

from checkpoints import CheckpointReader
from jaxinfer.quant import schemes
from jaxinfer.quant.quantize import quantize_int4, quantize_int8
from jaxinfer.quant.weights import QuantizedWeight

METHODS = ("int8", "int4", "gguf")
# Checkpoints stored quantized by another tool, served as stored (quant/schemes.py).
STORED_METHODS = schemes.METHODS
CHOICES = ("auto", "none", *METHODS, *STORED_METHODS)  # what the API and the CLI accept
DEFAULT_GROUP_SIZE = 64
# Weights per block (K-quants: per sub-block) of the GGUF types, the grid their values sit on.
GGUF_GRIDS = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q8_1": 32}
GGUF_GRIDS.update({"Q2_K": 16, "Q3_K": 16, "Q4_K": 32, "Q5_K": 32, "Q6_K": 16, "Q8_K": 256})
PARTS = ("values", "scales", "zeros", "offsets", "perm")  # a quantized weight's arrays, NAME.values, ...
# The embedding [V, E] and an untied LM head [E, V], by their input (contracted) axes: every
# family names them so (ModelParams), and a tied LM head contracts the embedding over E.
EMBEDDING_INPUTS = {"embed": (1,), "lm_head": (0,)}
# quantization="auto" on a GGUF file: keep its quantized blocks on these backends, dequantize
# them at load elsewhere. On the CPU native blocks decode slower (SmolLM2-135M Q4_1, LLM
# defaults, 2-core x86_64 shared with other jobs, 2026-11-23: 5.0 vs 9.4 tok/s at batch 1, 26.3
# vs 32.6 at batch 8): its float32 matmuls are compute-bound and every step re-expands the
# integers. Accelerators decode memory-bound, where reading 4.5-8.5 bits a weight beats 16-32.
GGUF_NATIVE_BACKENDS = ("gpu", "tpu", "cuda", "rocm")
PyTree = Any  # a model's parameter tree (a flax.struct dataclass of arrays and quantized weights)


class StoredSpec(Protocol):
    """What quantization reads of a checkpoint tensor's spec (jaxinfer.models.specs.TensorSpec)."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    @property
    def name(self) -> str: ...
    @property
    def field(self) -> str: ...
    @property
    def ckpt_shape(self) -> tuple[int, ...]: ...
    @property
    def to_ours(self) -> Callable[[np.ndarray], np.ndarray]: ...


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """method: "int8" (per output channel, or per group of inputs), "int4" (group-wise, with float
    offsets), "gguf" (a GGUF file's own quantized blocks kept), a STORED_METHODS checkpoint's own
    layouts kept (`stored`: its schemes, read from its config), or "auto" (resolved per checkpoint
    by `resolve`)."""

    method: str
    # Inputs sharing one scale: int4 default 64; int8 default 0 = one scale per output channel.
    group_size: int | None = None
    embedding: bool = False  # int8 / int4: the embedding and LM head quantized too
    # group_size was left to its default (a GGUF source then aligns it to its blocks: resolve)
    group_default: bool = dataclasses.field(default=False, compare=False, repr=False)
    # A stored quantization's schemes (None once saved to orbax: its layouts are in the arrays)
    # and the quantization its weights' inputs get on the fly, (kind, per) (quant/activations.py).
    stored: schemes.StoredQuantization | None = dataclasses.field(default=None, compare=False, repr=False)
    activations: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS + STORED_METHODS + ("auto",):
            raise ValueError(f"unknown quantization {self.method!r}; choose one of {list(CHOICES)}")
        if self.group_size is None:
            object.__setattr__(self, "group_size", DEFAULT_GROUP_SIZE if self.method == "int4" else 0)
            object.__setattr__(self, "group_default", True)
        per_channel = self.group_size == 0 and self.method != "int4" and not isinstance(self.group_size, bool)
        if not per_channel and (
            isinstance(self.group_size, bool)
            or not isinstance(self.group_size, int)
            or self.group_size < 2
            or self.group_size % 2
        ):
            raise ValueError(
                f"quantization_group_size={self.group_size!r}: expected an even integer >= 2 (e.g. 32, 64 or 128)"
            )
        if self.embedding and self.method not in ("int8", "int4"):
            raise ValueError(
                f"quantize_embedding=True needs quantization int8 or int4, not {self.method!r} "
                "(a GGUF file's quantized embedding is kept by quantization='gguf')"
            )

    @classmethod
    def parse(cls, method: str | None, group_size: int | None = None, embedding: bool = False) -> QuantConfig | None:
        """None or "none" -> None; otherwise a checked QuantConfig."""
        if method is None or method == "none":
            if embedding:
                raise ValueError("quantize_embedding=True needs quantization int8 or int4, not none")
            return None
        return cls(method, group_size, bool(embedding))

    @property
    def group(self) -> int:
        """`group_size` as settled at construction (0: one scale per output channel)."""
        return self.group_size or 0

    @property
    def per_tensor_layouts(self) -> bool:
        """Whether each weight has a layout of its own (a GGUF's blocks, a stored checkpoint's
        schemes), read from its arrays' shapes and dtypes rather than from this config."""
        return self.method == "gguf" or self.method in STORED_METHODS

    def to_metadata(self) -> dict[str, Any]:
        acts = {} if self.activations is None else {"activations": list(self.activations)}
        return {"method": self.method, "group_size": self.group_size or None, "embedding": self.embedding, **acts}

    @classmethod
    def from_metadata(cls, record: Mapping[str, Any] | None) -> QuantConfig | None:
        if not record:
            return None
        acts, embedding = record.get("activations"), bool(record.get("embedding", False))
        return cls(record["method"], record.get("group_size"), embedding, activations=acts and tuple(acts))

    @classmethod
    def of_stored(cls, stored: schemes.StoredQuantization) -> QuantConfig:
        acts = stored.groups[0][1]
        activations = None if acts.activations is None else (acts.activations, acts.activations_per)
        return cls(stored.method, 0, stored=stored, activations=activations)

    def inputs(self, field: str, linear_inputs: Mapping[str, tuple[int, ...]]) -> tuple[int, ...] | None:
        """The input axes of `field` if this quantization replaces it, else None."""
        if field in linear_inputs:
            return linear_inputs[field]
        if self.method in STORED_METHODS and field == "lm_head":  # where its scheme targets it
            return EMBEDDING_INPUTS[field]
        if self.method == "gguf" or self.embedding:
            return EMBEDDING_INPUTS.get(field)
        return None


def gguf_grid(kinds: set[str]) -> int | None:
    """The narrowest block (or K-quant sub-block) a GGUF's quantized linear weights sit on: the
    grid a requantization to int4 must not coarsen (None: float weights, no grid)."""
    widths = [GGUF_GRIDS[k] for k in kinds if k in GGUF_GRIDS]
    return min(widths) if widths else None


def aligned_to_grid(asked: QuantConfig, grid: int | None, where: str) -> QuantConfig:
    """int4 / int8 of a GGUF whose weights already sit on `grid`-wide blocks: the default group
    size (int8's default: one scale per output channel, a step coarser than many of a row's
    blocks) becomes the grid's (one rounding onto the source's own grid, not a second onto a
    coarser one); a coarser group asked for by name is refused, naming the one to use."""
    if asked.method not in ("int4", "int8") or grid is None or 0 < asked.group <= grid:
        return asked
    if asked.group_default:
        return dataclasses.replace(asked, group_size=grid, group_default=False)
    raise ValueError(
        f"{where}: quantization_group_size={asked.group} would round the GGUF's weights, stored in "
        f"blocks of {grid}, a second time onto a coarser grid; use quantization_group_size={grid} "
        "(or quantization='gguf' to keep the file's own blocks)"
    )


def resolve(
    asked: QuantConfig | None,
    fmt: str,
    saved: QuantConfig | None,
    has_linear: bool,
    backend: str,
    where: str,
    grid: int | None = None,
    stored: schemes.StoredQuantization | None = None,
) -> QuantConfig | None:
    """The quantization a load ends with. `fmt`: "hf", "gguf" or "ours" (orbax, `saved` its own:
    kept, and asking for another is an error); "auto" keeps a GGUF file's blocks on
    GGUF_NATIVE_BACKENDS when the family can take quantized linear weights, else it is none.
    `grid`: a GGUF's block width (gguf_grid), which int4 aligns to (aligned_to_grid). `stored`:
    an HF checkpoint's own quantization (compressed-tensors), kept by "auto" or its name on every
    backend, dequantized by none (None), never requantized."""
    if stored is not None and asked is not None:
        if asked.method not in ("auto", stored.method):
            raise ValueError(
                f"{where} is stored quantized ({stored.describe()}); it loads as stored (quantization "
                f"auto or {stored.method}) or dequantized (none), not requantized as {asked.method!r}"
            )
        return QuantConfig.of_stored(stored)
    if saved is not None:
        if asked is not None and asked.method != "auto" and asked != saved:
            raise ValueError(
                f"{where}: the checkpoint is quantized as {saved.to_metadata()}; cannot load "
                f"it as quantization={asked.method!r} (group size {asked.group_size})"
            )
        return saved
    if asked is not None and asked.method in STORED_METHODS:
        raise ValueError(f"quantization={asked.method!r}: {where} is not a {asked.method} checkpoint")
    if asked is None:
        return None
    if asked.method == "auto":
        native = fmt == "gguf" and has_linear and backend in GGUF_NATIVE_BACKENDS
        return QuantConfig("gguf") if native else None
    if asked.method == "gguf" and fmt != "gguf":
        raise ValueError(
            f"quantization='gguf' keeps a GGUF file's quantized blocks, but {where} is "
            f"not a GGUF file; use int8 or int4 to quantize it"
        )
    return aligned_to_grid(asked, grid, where) if fmt == "gguf" else asked


def quantize_field(
    array: np.ndarray, field: str, inputs: tuple[int, ...], quant: QuantConfig, scale_dtype: DTypeLike
) -> QuantizedWeight:
    """One linear weight in our layout (`inputs`: its input axes) -> its host QuantizedWeight."""
    if quant.method == "int8":
        return quantize_int8(array, inputs, scale_dtype, quant.group, name=field)
    return quantize_int4(array, inputs, quant.group, scale_dtype, name=field)


def component_shapes(
    shape: tuple[int, ...], inputs: tuple[int, ...], quant: QuantConfig, scale_dtype: DTypeLike
) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The arrays a weight of this float shape is stored as: {component: (shape, dtype)}."""
    if quant.method == "int8":
        scales = [1 if i in inputs else n for i, n in enumerate(shape)]
        if quant.group:  # grouped along the last input axis, varying over the others
            scales = [n for n in shape]
            scales[inputs[-1]] //= quant.group
        return {"values": (tuple(shape), np.dtype(np.int8)), "scales": (tuple(scales), np.dtype(scale_dtype))}
    axis = inputs[-1]
    values, scales = list(shape), list(shape)
    values[axis] //= 2
    scales[axis] //= quant.group
    return {
        "values": (tuple(values), np.dtype(np.uint8)),
        "scales": (tuple(scales), np.dtype(scale_dtype)),
        "offsets": (tuple(scales), np.dtype(scale_dtype)),
    }


def component_specs[S: StoredSpec](
    spec: S, inputs: tuple[int, ...], quant: QuantConfig, scale_dtype: DTypeLike
) -> list[S]:
    """A checkpoint TensorSpec of a linear weight -> one spec per stored array (NAME.values, ...)."""
    shapes = component_shapes(spec.ckpt_shape, inputs, quant, scale_dtype)
    return [
        dataclasses.replace(spec, name=f"{spec.name}.{part}", ckpt_shape=shape) for part, (shape, _) in shapes.items()
    ]


def stored_components[S: StoredSpec](
    reader: CheckpointReader, spec: S, inputs: tuple[int, ...], quant: QuantConfig, scale_dtype: DTypeLike
) -> list[S]:
    """The checkpoint specs a quantized orbax checkpoint stores `spec` as: our int8 / int4 by
    `component_specs`; a GGUF-native one as the arrays it holds (a tensor GGUF kept float, or
    whose blocks did not fit our layout, is stored float under its own name)."""
    if not quant.per_tensor_layouts:
        specs = component_specs(spec, inputs, quant, scale_dtype)
        if quant.method == "int4" and f"{spec.name}.zeros" in set(reader.keys()):  # saved with zero points
            specs = [
                dataclasses.replace(s, name=f"{spec.name}.zeros") if s.name.endswith(".offsets") else s for s in specs
            ]
        return specs
    names = set(reader.keys())
    parts = [f"{spec.name}.{part}" for part in PARTS if f"{spec.name}.{part}" in names]
    if not parts:
        return [spec]
    return [dataclasses.replace(spec, name=name, ckpt_shape=tuple(reader.shape(name))) for name in parts]


def join_components(
    arrays: Mapping[str, Any], name: str, inputs: tuple[int, ...], quant: QuantConfig, dtype: DTypeLike | None = None
) -> QuantizedWeight:
    """The QuantizedWeight restored as NAME.values, NAME.scales (, NAME.zeros, NAME.offsets)."""
    values, scales = arrays[f"{name}.values"], arrays[f"{name}.scales"]
    method = {np.dtype(np.uint8): "int4", np.dtype(np.int8): "int8"}.get(np.dtype(values.dtype), "fp8")
    if not quant.per_tensor_layouts:
        group = quant.group
    elif all(scales.shape[i] == 1 for i in inputs) and quant.method != "gguf":  # one scale per channel
        group = 0
    else:
        n = values.shape[inputs[-1]] * (2 if method == "int4" else 1)
        group = n // scales.shape[inputs[-1]]
        if scales.shape[inputs[-1]] == 1 and len(inputs) > 1:  # groups may span rows of the axis before
            group = n * values.shape[inputs[-2]] // scales.shape[inputs[-2]]
    zeros, offsets, perm = (arrays.get(f"{name}.{part}") for part in ("zeros", "offsets", "perm"))
    return QuantizedWeight(values, scales, zeros, method, inputs, group, offsets, dtype, quant.activations, perm)


def flat_arrays(name: str, value: Any) -> dict[str, Any]:  # value: an array, or a QuantizedWeight
    """{checkpoint name: array} of a field: itself, or a QuantizedWeight's arrays."""
    if isinstance(value, QuantizedWeight):
        return {f"{name}.{part}": array for part, array in value.arrays().items()}
    return {name: value}
