"""Lazy safetensors reading: single files and sharded checkpoints with an index.

Tensors are numpy views over a memory map, read tensor by tensor, so loading a checkpoint never
holds a second full copy in host memory. The header is validated against the file size when the
file is opened, so a truncated download fails at once with the tensor and byte counts named.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from checkpoints.errors import CheckpointError

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
INDEX_NAME = "model.safetensors.index.json"


class SafetensorsFile:
    """One .safetensors file: `keys()`, `shape(name)`, `get(name) -> np.ndarray` (a view)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"safetensors file not found: {self.path}")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{self.path}: too short to be a safetensors file ({size} bytes)")
            (header_len,) = struct.unpack("<Q", raw)
            if header_len > size - 8:
                raise CheckpointError(
                    f"{self.path}: header length {header_len} exceeds the file size {size}: "
                    "truncated or not a safetensors file"
                )
            try:
                header = json.loads(f.read(header_len))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{self.path}: unreadable safetensors header: {e}") from e
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._data_start = 8 + header_len
        self._entries: dict[str, tuple[type, tuple[int, ...], int, int]] = {}  # dtype, shape, span
        for name, info in header.items():
            dtype = _DTYPES.get(info.get("dtype"))
            if dtype is None:
                raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
            begin, end = info["data_offsets"]
            shape = tuple(info["shape"])
            expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            if end - begin != expected:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} spans {end - begin} bytes, but its shape "
                    f"{shape} and dtype {info['dtype']} need {expected}"
                )
            if self._data_start + end > size:
                raise CheckpointError(
                    f"{self.path}: truncated: tensor {name!r} needs bytes up to "
                    f"{self._data_start + end} but the file has {size}"
                )
            self._entries[name] = (dtype, shape, begin, end)
        self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r") if size else None

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def get(self, name: str) -> np.ndarray:
        if name not in self._entries or self._mmap is None:  # no mapping: an empty file, no tensors
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        dtype, shape, begin, end = self._entries[name]
        raw = self._mmap[self._data_start + begin : self._data_start + end]
        return raw.view(dtype).reshape(shape)


class SafetensorsCheckpoint:
    """A directory holding model.safetensors, or shards listed in model.safetensors.index.json."""

    def __init__(self, directory: str | Path) -> None:
        directory = self.directory = Path(directory)
        index = directory / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
            files = {fname: SafetensorsFile(directory / fname) for fname in sorted(set(weight_map.values()))}
            self._where: dict[str, SafetensorsFile] = {}
            for name, fname in weight_map.items():
                if name not in files[fname].keys():
                    raise CheckpointError(f"{index}: lists {name!r} in {fname}, which does not hold it")
                self._where[name] = files[fname]
        else:
            paths = sorted(directory.glob("*.safetensors"))
            if not paths:
                raise FileNotFoundError(f"no .safetensors files in {directory}")
            self._where = {}
            for p in paths:
                f = SafetensorsFile(p)
                for name in f.keys():
                    self._where[name] = f

    def keys(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name].shape(name)

    def get(self, name: str) -> np.ndarray:
        return self._where[name].get(name)
