"""Reading a model family's parameters out of a checkpoint: its specs say which tensors must
exist and how each becomes a field; each is read, checked, converted (or quantized) and placed.

    read_fields(reader, config, fmt, dtype, place)  -> (top fields, one dict per layer)
    load_params(...)                                -> the family's assembled parameter tree

The loader (jaxinfer/loader.py) opens the checkpoint and calls these. Tensors are read one at a
time, so host memory holds at most one converted tensor beyond the memory-mapped file (for one
device, none: a float tensor goes over as stored and is transposed and converted there); every
missing, unexpected or misshaped tensor is named in one error. With a quantization each linear
weight is quantized on the host before it is placed; "gguf" repacks a GGUF file's own blocks;
an orbax checkpoint is restored straight onto the devices (`place.target` says how each array is
split, and every process reads only its own shards).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from checkpoints import CheckpointError, CheckpointReader, GGUFCheckpoint, OrbaxCheckpoint, SafetensorsCheckpoint
from jaxinfer.config import ModelConfig
from jaxinfer.models.layers import Fields
from jaxinfer.models.registry import ModelFamily, ModelParams, get_family
from jaxinfer.models.specs import TensorSpec
from jaxinfer.quant import QuantConfig, QuantizedWeight, join_components, quantize_field, resolve, stored_components
from jaxinfer.quant.compressed import expected_specs, module_of, read_module, stored_quantization
from jaxinfer.quant.config import gguf_grid
from jaxinfer.quant.gguf import native_weight
from jaxinfer.quant.schemes import StoredQuantization
from sharding import DevicePlacer, Placer

logger = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
READ_THREADS = 2  # checkpoint tensors read at once (read_fields)
ORBAX_FORMAT = "ours"  # an orbax checkpoint holds our own fields under our own names


def resolve_dtype(dtype: DTypeLike) -> np.dtype:
    """A dtype name or dtype; "auto" is bfloat16 on accelerators and float32 on the CPU, where
    XLA's bfloat16 matmuls run several times slower than float32."""
    if dtype == "auto":
        return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; choose auto or one of {sorted(DTYPES)}")
        return jnp.dtype(DTYPES[dtype])
    dtype = jnp.dtype(dtype)
    if dtype not in {jnp.dtype(d) for d in DTYPES.values()}:
        raise ValueError(f"unsupported dtype {dtype}; choose one of {sorted(DTYPES)}")
    return dtype


def _check_tensors(reader: CheckpointReader, specs: list[TensorSpec], ignored: tuple[str, ...], where: str) -> None:
    names = set(reader.keys())
    wanted = {s.name for s in specs}
    missing = [s.name for s in specs if s.name not in names]
    unexpected = sorted(n for n in names - wanted if not n.endswith(ignored))
    misshaped = [
        f"{s.name}: expected {s.ckpt_shape}, found {tuple(reader.shape(s.name))}"
        for s in specs
        if s.name in names and tuple(reader.shape(s.name)) != s.ckpt_shape
    ]
    problems = [
        f"{kind} tensors ({len(names)}): {', '.join(names[:8])}" + (" ..." if len(names) > 8 else "")
        for kind, names in (("missing", missing), ("unexpected", unexpected))
        if names
    ]
    if misshaped:
        problems.append("wrongly shaped tensors: " + "; ".join(misshaped[:8]))
    if problems:
        raise CheckpointError(f"{where}: checkpoint does not match the model config: " + " | ".join(problems))


def load_params(
    reader: CheckpointReader,
    config: ModelConfig,
    fmt: str,
    dtype: DTypeLike,
    place: Placer | None = None,
    where: str = "checkpoint",
    quantization: QuantConfig | None = None,
) -> ModelParams:
    """Reads, checks and converts every tensor; `place` puts each on its device(s)."""
    family = get_family(config.family)
    top, per_layer = read_fields(reader, config, fmt, dtype, place, where, quantization=quantization)
    return family.assemble(config, top, per_layer)


def checkpoint_quantization(
    reader: CheckpointReader, fmt: str, asked: QuantConfig | None, where: str, family: ModelFamily | None = None
) -> QuantConfig | None:
    """The quantization a load ends with (jaxinfer.quant.resolve): an orbax checkpoint saved
    quantized keeps its own; "auto" keeps a GGUF file's blocks on accelerators."""
    saved, grid = None, None
    if fmt == ORBAX_FORMAT and isinstance(reader, OrbaxCheckpoint):  # fmt "ours": an orbax reader
        saved = QuantConfig.from_metadata(reader.metadata.get("quantization"))
    if isinstance(reader, GGUFCheckpoint):  # the blocks its layers' weights sit on
        grid = gguf_grid({reader.quant_type(name) for name in reader.keys() if name.startswith("blk.")})
    has_linear = family is None or bool(family.linear_inputs)
    return resolve(asked, fmt, saved, has_linear, jax.default_backend(), where, grid, _stored(reader, where))


def _stored(reader: CheckpointReader, where: str) -> StoredQuantization | None:
    """An HF checkpoint's own quantization (its config.json's quantization_config)."""
    return stored_quantization(reader.directory, where) if isinstance(reader, SafetensorsCheckpoint) else None


def read_fields(
    reader: CheckpointReader,
    config: ModelConfig,
    fmt: str,
    dtype: DTypeLike,
    place: Placer | None = None,
    where: str = "checkpoint",
    progress: Callable[[int], None] | None = None,
    quantization: QuantConfig | None = None,
) -> tuple[Fields, list[Fields]]:
    """Every checkpoint tensor as our field, placed: (top fields, one dict per layer), before the
    family assembles them; linear weights quantized when `quantization` (or the checkpoint) says
    so. `progress(n)` is told of each n tensors done."""
    family = get_family(config.family)
    resolved = resolve_dtype(dtype)
    quant = checkpoint_quantization(reader, fmt, quantization, where, family)
    if quant is not None and not family.linear_inputs:
        raise ValueError(f"model family {family.name!r} does not support quantization={quant.method!r} yet")
    specs = family.checkpoint_specs(config, fmt)
    place = place or DevicePlacer()
    top: Fields = {}
    per_layer: list[Fields] = [{} for _ in range(config.num_layers)]
    if fmt == ORBAX_FORMAT and isinstance(reader, OrbaxCheckpoint):  # fmt "ours": an orbax reader
        for field, value, layer in _restore_fields(reader, specs, resolved, place, quant, family, where):
            (top if layer is None else per_layer[layer])[field] = value
        if progress:
            progress(len(specs))
        return top, per_layer
    stored = quant.stored if quant is not None and quant.stored is not None else _stored(reader, where)
    linear = set(family.linear_inputs) | {"lm_head"}
    checked = specs if stored is None else expected_specs(specs, stored, linear, where)
    _check_tensors(reader, checked, family.ignored_tensors, where)

    def read(spec: TensorSpec) -> jax.Array | QuantizedWeight:
        inputs = quant.inputs(spec.field, family.linear_inputs) if quant is not None else None
        scheme = stored.scheme_for(module_of(spec.name)) if stored is not None and spec.field in linear else None
        if scheme is not None:  # stored quantized: kept as stored where quant says so, else dequantized
            value = read_module(reader, spec, inputs or (0,), scheme, resolved, inputs is not None, where)
            return (
                value.map(functools.partial(place, spec)) if isinstance(value, QuantizedWeight) else place(spec, value)
            )
        return _read_field(reader, spec, None if stored else inputs, quant, resolved, place)  # float outside

    # Tensors read (dequantized, converted, placed) READ_THREADS at a time: numpy's dequantizing
    # and converting, and the placing, run without the GIL for the most part.
    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="read") as pool:
        for spec, value in zip(specs, pool.map(read, specs), strict=True):
            (top if spec.layer is None else per_layer[spec.layer])[spec.field] = value
            if progress:
                progress(1)
    return top, per_layer


def _read_field(
    reader: CheckpointReader,
    spec: TensorSpec,
    inputs: tuple[int, ...] | None,
    quant: QuantConfig | None,
    dtype: np.dtype,
    place: Placer,
) -> jax.Array | QuantizedWeight:
    """One tensor of an HF or GGUF checkpoint as our field, placed: GGUF blocks repacked (quant
    "gguf", a GGUF file's reader; a tensor whose blocks do not fit stays float), quantized, or float.
    A float tensor for one device is copied there as the file holds it and transposed and
    converted by the device (a strided copy on the host ran at ~0.3-0.6 GB/s: 27 s for an 8B
    model's 15 GB on an H200's host); over a mesh it is rearranged on the host, then split."""
    if inputs is not None and quant is not None and quant.method == "gguf" and isinstance(reader, GGUFCheckpoint):
        weight = native_weight(reader, spec, inputs, dtype)
        if weight is not None:
            return weight.map(lambda a: place(spec, a))
        logger.info("%s (%s) stays float", spec.name, reader.quant_type(spec.name))
        inputs = None
    stored = np.asarray(reader.get(spec.name))
    if inputs is not None and quant is not None:
        return quantize_field(spec.to_ours(stored), spec.field, inputs, quant, dtype).map(lambda a: place(spec, a))
    if isinstance(place, DevicePlacer):  # one device: the bytes go over as stored, rearranged there
        return spec.to_ours(place(spec, stored)).astype(dtype)
    return place(spec, np.ascontiguousarray(spec.to_ours(stored).astype(dtype, copy=False)))


def _restore_fields(
    reader: OrbaxCheckpoint,
    specs: list[TensorSpec],
    dtype: np.dtype,
    place: Placer,
    quant: QuantConfig | None,
    family: ModelFamily,
    where: str,
) -> Iterator[tuple[str, Any, int | None]]:
    """(field, value, layer) of every spec, restored from an orbax checkpoint; a quantized
    checkpoint's weights from their stored arrays, a float one's quantized if asked."""
    saved = QuantConfig.from_metadata(reader.metadata.get("quantization"))
    quant_of = saved or quant
    inputs = {
        s.name: i
        for s in specs
        if quant_of is not None and (i := quant_of.inputs(s.field, family.linear_inputs)) is not None
    }
    stored = {
        s.name: stored_components(reader, s, inputs[s.name], saved, dtype) if saved and s.name in inputs else [s]
        for s in specs
    }
    requantize = quant is not None and saved is None
    _check_tensors(reader, [part for parts in stored.values() for part in parts], (), where)
    keep = (
        {p.name for parts in stored.values() if len(parts) > 1 for p in parts}
        if saved is not None and saved.method == "gguf"
        else set()
    )  # GGUF scales keep their dtype
    arrays = _restore(
        reader, [p for s in specs if not (requantize and s.name in inputs) for p in stored[s.name]], dtype, place, keep
    )
    for spec in specs:
        value: jax.Array | QuantizedWeight
        if saved is not None and len(stored[spec.name]) > 1:
            value = join_components(arrays, spec.name, inputs[spec.name], saved, dtype)
        elif quant is not None and requantize and spec.name in inputs:  # read whole here, quantized, placed
            value = quantize_field(np.asarray(reader.get(spec.name)), spec.field, inputs[spec.name], quant, dtype).map(
                functools.partial(place, spec)
            )
        else:
            value = arrays[spec.name]
        yield spec.field, value, spec.layer


def _restore(
    reader: OrbaxCheckpoint,
    specs: list[TensorSpec],
    dtype: np.dtype,
    place: Placer,
    keep: frozenset[str] | set[str] = frozenset(),
) -> dict[str, jax.Array]:
    """Every array read straight onto its devices; floating arrays cast to `dtype` (except those
    named in `keep`), others (the integers of a quantized model) kept as saved."""

    def target(spec: TensorSpec) -> jax.ShapeDtypeStruct:
        saved = reader.dtype(spec.name)
        return place.target(
            spec.field,
            spec.ckpt_shape,
            dtype if jnp.issubdtype(saved, jnp.floating) and spec.name not in keep else saved,
        )

    arrays = reader.restore({spec.name: target(spec) for spec in specs})
    return {spec.name: place.finish(spec.field, arrays[spec.name]) for spec in specs}
