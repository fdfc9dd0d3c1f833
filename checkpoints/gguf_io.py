"""GGUF reading with the `gguf` package: metadata as plain values, tensors dequantized lazily.

Tensors come back in HF's row-major shapes ([out, in] for projections): F32 and F16 as stored,
everything else (BF16 and the quantized types) dequantized to float32, one at a time from the
memory-mapped file: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants that
`gguf.quants` can dequantize. `raw(name)` gives a tensor's stored bytes instead (its blocks, for
a reader that keeps them quantized), `quant_type(name)` their type.

gguf's parse of the metadata (a vocabulary's strings one by one) is kept as a JSON index per
version of a file ($JAXINFER_GGUF_INDEX_DIR, default ~/.cache/jaxinfer/gguf; "none": off): a
later process reads the metadata and the tensors' places from it and maps the tensors as gguf's
reader would (tests/checkpoints/test_readers.py compares both, tensor by tensor).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from checkpoints.atomic import atomic_target
from checkpoints.errors import CheckpointError

logger = logging.getLogger(__name__)

INDEX_DIR_VAR = "JAXINFER_GGUF_INDEX_DIR"
DEFAULT_INDEX_DIR = "~/.cache/jaxinfer/gguf"
INDEX_FORMAT = 1
# Tensor types gguf's reader gives as typed arrays of their elements (the others: their bytes).
PLAIN_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16}
PLAIN_TYPES |= {"I32": np.int32, "I64": np.int64}


class GGUFCheckpoint:
    """One .gguf file: `metadata` (key -> value), `keys()`, `shape(name)`, `quant_type(name)`,
    `get(name) -> np.ndarray` (dequantized, in HF's shape)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        stat = self.path.stat()
        try:
            self._tensors, metadata = _parse(str(self.path.resolve()), stat.st_size, stat.st_mtime_ns)
        except Exception as e:  # gguf raises ValueError/struct.error/IndexError on bad files
            raise CheckpointError(f"{self.path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
        self.metadata: dict[str, Any] = dict(metadata)  # values are whatever each GGUF field holds

    def keys(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self._tensors[name].shape))

    def quant_type(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored (a memory-mapped uint8 view), [rows..., bytes per row]."""
        if name not in self._tensors:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        return np.asarray(self._tensors[name].data).view(np.uint8)

    def get(self, name: str) -> np.ndarray:
        from gguf import GGMLQuantizationType, quants

        if name not in self._tensors:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        t = self._tensors[name]
        shape = self.shape(name)
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            return np.asarray(t.data).reshape(shape)
        try:
            data = quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} uses quantization {t.tensor_type.name}, "
                "which this gguf package cannot dequantize"
            ) from e
        return np.asarray(data, dtype=np.float32).reshape(shape)


@functools.cache
def _reader_class():
    """gguf's reader, reading through a plain ndarray view of its memory map.

    gguf's GGUFReader slices its `np.memmap` for every value it parses (one slice per string of
    a vocabulary: ~250k for SmolLM2), and each slice of a memmap builds a memmap subclass object:
    5-10 s on a 2-core machine, four fifths of it in numpy's memmap bookkeeping. The same slices
    of a plain view of the same buffer take a fifth of that; the tensors' data become plain
    views of the map as well (so dequantizing them builds no memmaps either). Only `_get`, the
    reader's one accessor, is replaced: the format is still parsed by gguf
    (tests/checkpoints/test_readers.py compares both readers field by field)."""
    import gguf

    class PlainViewReader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            dtype, count = np.dtype(dtype), int(count)
            arr = plain[offset : offset + dtype.itemsize * count].view(dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr if order == "I" else arr.view(arr.dtype.newbyteorder(order))  # "I": as is

    return PlainViewReader


@functools.lru_cache(maxsize=2)
def _parse(path: str, size: int, mtime_ns: int) -> tuple[dict, dict[str, Any]]:
    """(tensors by name, metadata) of a GGUF file, parsed once per process for each version of
    the file (path, size and modification time): gguf's reader walks a vocabulary's strings one
    by one (~1.5 s for SmolLM2's 49k tokens and merges on 2 cores, through `_reader_class`),
    and a process may open one file twice (a model as its own draft; an engine built again). The
    tensors are views of one read-only memory map. What the parse found is kept in an index file
    (`_index_path`), which the next process reads instead of parsing again."""
    index = _index_path(path, size, mtime_ns)
    if index is not None and (known := _read_index(index, path)) is not None:
        return known
    reader = _reader_class()(path)
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            metadata[key] = field.contents()
        except Exception:  # a field whose type gguf cannot decode is simply not exposed
            continue
    tensors = {t.name: t for t in reader.tensors}
    if index is not None:
        _write_index(index, tensors, metadata)
    return tensors, metadata


class IndexedTensor(NamedTuple):
    """A tensor of an indexed GGUF file: what GGUFCheckpoint reads of gguf's ReaderTensor."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF's order: innermost first
    data: np.ndarray  # a view of the file's memory map, typed and shaped as gguf's reader gives it


def _index_path(path: str, size: int, mtime_ns: int) -> Path | None:
    """The index of this version of the file: under $JAXINFER_GGUF_INDEX_DIR (default
    ~/.cache/jaxinfer/gguf; "none": no index), named by a hash of the path, size, modification
    time, the index format and gguf's version (whose parse it holds)."""
    import gguf

    directory = os.environ.get(INDEX_DIR_VAR, DEFAULT_INDEX_DIR)
    if directory.strip().lower() in ("", "none"):
        return None
    version = getattr(gguf, "__version__", "") or importlib.metadata.version("gguf")
    key = json.dumps([INDEX_FORMAT, version, path, size, mtime_ns])
    return Path(directory).expanduser() / f"{hashlib.sha256(key.encode()).hexdigest()}.json"


def _read_index(index: Path, path: str) -> tuple[dict, dict[str, Any]] | None:
    """(tensors, metadata) from an index; None when there is none or it cannot be used (the file
    is parsed again and the index rewritten)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    try:
        known = json.loads(index.read_text())
        plain = np.memmap(path, mode="r").view(np.ndarray)
        tensors = {}
        for name, raw_type, dims, offset in known["tensors"]:
            kind = GGMLQuantizationType(raw_type)
            n_elems = int(np.prod(dims))
            shape = tuple(reversed(dims))
            dtype = PLAIN_TYPES.get(kind.name)
            if dtype is None:  # blocks: their bytes, [rows..., bytes per row], as gguf's reader has them
                block_size, type_size = GGML_QUANT_SIZES[kind]
                dtype, count, shape = (
                    np.uint8,
                    n_elems * type_size // block_size,
                    quant_shape_to_byte_shape(shape, kind),
                )
            else:
                count = n_elems
            data = plain[offset : offset + np.dtype(dtype).itemsize * count].view(dtype).reshape(shape)
            tensors[name] = IndexedTensor(name, kind, np.asarray(dims, np.uint64), data)
        return tensors, known["metadata"]
    except Exception as e:  # noqa: BLE001  # any doubt: parse the file again
        if not isinstance(e, FileNotFoundError):
            logger.debug("GGUF index %s not used: %s", index, e)
        return None


def _write_index(index: Path, tensors: dict, metadata: dict[str, Any]) -> None:
    try:
        table = [[t.name, int(t.tensor_type), [int(d) for d in t.shape], int(t.data_offset)] for t in tensors.values()]
        text = json.dumps({"tensors": table, "metadata": metadata})
        with atomic_target(index) as tmp:
            tmp.write_text(text)
    except (OSError, TypeError, ValueError) as e:  # metadata JSON cannot hold, a read-only home: no index
        logger.debug("GGUF index %s not written: %s", index, e)
