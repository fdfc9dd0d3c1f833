"""TensorSpec: how one checkpoint tensor becomes one of our parameters.

A family's name map (e.g. llama/names.py) lists one TensorSpec per tensor it needs; the loader
checks names and shapes against the checkpoint and calls `to_ours` on each array it reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: its name, our field (and layer), its checkpoint shape, a converter."""

    name: str
    field: str
    layer: int | None
    ckpt_shape: tuple[int, ...]
    # The rearrangement into our layout, through array methods only (.T, reshape, swapaxes,
    # transpose, arithmetic), so it runs on a host array or, loaded for one device, a jax.Array.
    to_ours: Callable[[Any], Any]
