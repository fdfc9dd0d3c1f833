"""Checkpoint readers and writers: HF safetensors, GGUF, orbax. They know formats, not models."""

from __future__ import annotations

from checkpoints.errors import CheckpointError
from checkpoints.gguf_io import GGUFCheckpoint
from checkpoints.orbax_io import OrbaxCheckpoint, is_orbax_checkpoint, save_arrays, save_params, write_metadata
from checkpoints.reader import CheckpointReader
from checkpoints.safetensors_io import SafetensorsCheckpoint, SafetensorsFile

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "GGUFCheckpoint",
    "OrbaxCheckpoint",
    "SafetensorsCheckpoint",
    "SafetensorsFile",
    "is_orbax_checkpoint",
    "save_arrays",
    "save_params",
    "write_metadata",
]
