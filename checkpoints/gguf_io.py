"""GGUF reading with the `gguf` package: metadata as plain values, tensors dequantized lazily.

Tensors come back in HF's row-major shapes ([out, in] for projections): F32 and F16 as stored,
everything else (BF16 and the quantized types) dequantized to float32, one at a time from the
memory-mapped file: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants that
`gguf.quants` can dequantize. `raw(name)` gives a tensor's stored bytes instead (its blocks, for
a reader that keeps them quantized), `quant_type(name)` their type.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from checkpoints.errors import CheckpointError


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
    tensors are views of one read-only memory map."""
    reader = _reader_class()(path)
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            metadata[key] = field.contents()
        except Exception:  # a field whose type gguf cannot decode is simply not exposed
            continue
    return {t.name: t for t in reader.tensors}, metadata
