"""CheckpointReader: what every reader of a checkpoint (safetensors, GGUF, orbax) offers the loader:
the tensors' names and shapes, and one tensor read whole onto the host."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class CheckpointReader(Protocol):
    def keys(self) -> list[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def get(self, name: str) -> np.ndarray: ...
