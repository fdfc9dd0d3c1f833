"""HF safetensors directories and GGUF files -> jaxinfer orbax checkpoints (`jaxinfer convert`).

    DST/params/                   our fields in our layout ("embed", "layers.3.wq", ...), orbax;
                                  quantized weights as "layers.3.wq.values", ".scales", ".offsets"
    DST/config.json               the source's own (HF), or written from the GGUF's metadata
    DST/tokenizer.json | .model   copied (HF), or exported from the GGUF's vocabulary
    DST/tokenizer_config.json ... the special tokens and the chat template beside them
    DST/jaxinfer_checkpoint.json  format version, family, dtype, quantization, source; written last

Tensors are read, converted and placed one at a time, as the loader does, then saved together
(each process writes its own shards). With `mesh` the arrays are split over its devices while
converting, so no device holds more than its share; KV heads are saved unrepeated (a checkpoint
does not depend on the mesh it was converted on). `LLM(DST)` / `--model DST` restore it straight
onto any mesh. Quantized GGUF tensors are dequantized to `dtype` (kept as their blocks with
quantization "gguf").
"""

from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from checkpoints import CheckpointError, CheckpointReader, GGUFCheckpoint, save_arrays, write_metadata
from checkpoints.orbax_io import epath
from jaxinfer.config import ModelConfig
from jaxinfer.loader import gguf_tokenizer, open_checkpoint
from jaxinfer.lora.merge import MergedReader
from jaxinfer.lora.peft import read_adapter
from jaxinfer.models.reading import ORBAX_FORMAT, checkpoint_quantization, read_fields, resolve_dtype
from jaxinfer.models.registry import ModelFamily, get_family
from jaxinfer.quant import QuantConfig, flat_arrays
from jaxinfer.tokenizer import TokenizerError
from sharding import DevicePlacer, MeshPlacer, head_layout, make_mesh

if TYPE_CHECKING:
    from etils.epath import Path as EPath
    from tqdm import tqdm

logger = logging.getLogger(__name__)

# The files of an HF model directory that travel with its weights.
HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


@dataclasses.dataclass(frozen=True)
class ConvertStats:
    tensors: int
    parameters: int
    bytes: int
    dtype: str
    seconds: float


def convert(
    src: str | Path,
    dst: str | Path,
    dtype: str = "auto",
    mesh: str | None = None,
    progress: bool = True,
    quantization: QuantConfig | None = None,
    lora: str | Path | None = None,
) -> ConvertStats:
    """Converts `src` into a new orbax checkpoint directory `dst` (which must not exist, or be
    empty). dtype "auto" keeps an HF checkpoint's floating dtype and gives a GGUF bfloat16.
    `quantization`: linear weights are saved quantized (NAME.values, NAME.scales, NAME.offsets;
    "gguf": a GGUF file's own blocks repacked, with NAME.offsets where they have them) and load
    as saved. `lora`: a PEFT adapter directory merged into the weights (HF sources)."""
    start = time.perf_counter()
    dst_path = epath(dst)
    if dst_path.exists() and (not dst_path.is_dir() or any(dst_path.iterdir())):
        raise FileExistsError(f"destination {dst} exists and is not an empty directory")
    config, opened, fmt = open_checkpoint(src)
    reader = _with_lora(opened, fmt, config, lora, str(src))
    resolved = _convert_dtype(dtype, reader, fmt)
    family = get_family(config.family)
    quantization = checkpoint_quantization(reader, fmt, quantization, str(src), family)  # "auto" resolved
    place = _placer(mesh, config, family)
    specs = family.checkpoint_specs(config, ORBAX_FORMAT)
    bar = _bar(len(specs), progress)
    try:
        top, per_layer = read_fields(
            reader, config, fmt, resolved, place, str(src), bar.update, quantization=quantization
        )
    finally:
        bar.close()
    arrays = {
        name: array
        for s in specs
        for name, array in flat_arrays(s.name, (top if s.layer is None else per_layer[s.layer])[s.field]).items()
    }
    save_arrays(dst_path, arrays)
    files = _side_files(src, fmt, reader, config, dst_path)
    write_metadata(
        dst_path,
        {
            "family": config.family,
            "model_type": config.model_type,
            "dtype": resolved.name,
            "quantization": quantization and quantization.to_metadata(),
            "source": str(src),
            "source_format": fmt,
            "lora": None if lora is None else str(lora),
            "tensors": len(arrays),
            **files,
        },
    )
    return ConvertStats(
        tensors=len(arrays),
        parameters=sum(int(a.size) for a in arrays.values()),
        bytes=sum(int(a.nbytes) for a in arrays.values()),
        dtype=resolved.name,
        seconds=time.perf_counter() - start,
    )


def _with_lora(
    reader: CheckpointReader, fmt: str, config: ModelConfig, lora: str | Path | None, src: str
) -> CheckpointReader:
    """The checkpoint to convert, with the adapter at `lora` merged into its weights (HF sources
    only); an orbax checkpoint is refused (it is converted already)."""
    if fmt == ORBAX_FORMAT:
        raise CheckpointError(f"{src} is a jaxinfer orbax checkpoint already")
    if lora is None:
        return reader
    if fmt != "hf":
        raise CheckpointError(f"--lora {lora}: adapters are merged into HF safetensors checkpoints, not {fmt}")
    return MergedReader(reader, read_adapter(lora, config, max_rank=1 << 16), str(lora))


def _placer(mesh: str | None, config: ModelConfig, family: ModelFamily) -> DevicePlacer | MeshPlacer:
    """Where each converted tensor is put on its way to the file: one device, or the shards of
    `mesh` (each KV head stored once: the checkpoint is written as one logical array)."""
    if mesh is None:
        return DevicePlacer()
    device_mesh = make_mesh(mesh)
    layout = head_layout(device_mesh, config.num_heads, config.num_kv_heads)
    return MeshPlacer(device_mesh, family.param_axes, layout, repeat_kv=False)


def _convert_dtype(dtype: str, reader: CheckpointReader, fmt: str) -> np.dtype:
    if dtype != "auto":
        return resolve_dtype(dtype)
    if fmt == "hf":
        floating = [reader.get(n).dtype for n in reader.keys()[:8]]
        for d in floating:
            if np.dtype(d).name in ("bfloat16", "float16", "float32"):
                return resolve_dtype(np.dtype(d).name)
    return resolve_dtype("bfloat16")


def _side_files(
    src: str | Path, fmt: str, reader: CheckpointReader, config: ModelConfig, dst: EPath
) -> dict[str, list[str]]:
    """Writes config.json and the tokenizer files beside the params; -> metadata about them."""
    if fmt == "hf" or not isinstance(reader, GGUFCheckpoint):  # else "gguf" (orbax is not converted)
        copied = [name for name in HF_SIDE_FILES if (Path(src) / name).is_file()]
        for name in copied:
            (dst / name).write_bytes((Path(src) / name).read_bytes())
        return {"files": copied}
    (dst / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    try:
        tokenizer = gguf_tokenizer(reader.metadata, config, str(src))
    except TokenizerError as e:
        logger.warning("%s: the tokenizer is not exported (%s); prompts must be token ids", src, e)
        return {"files": ["config.json"]}
    with tempfile.TemporaryDirectory(prefix="jaxinfer-tokenizer-") as local:
        tokenizer.save_pretrained(local)  # local first: dst may be a gs:// URI
        names = sorted(p.name for p in Path(local).iterdir())
        for name in names:
            (dst / name).write_bytes((Path(local) / name).read_bytes())
    return {"files": ["config.json", *names]}


def _bar(total: int, enabled: bool) -> tqdm:
    from tqdm import tqdm

    return tqdm(total=total, desc="converting", unit="tensor", disable=not enabled, dynamic_ncols=True)
