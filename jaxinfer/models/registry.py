"""Model families by name, and the one record every family provides to the loader and runner."""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: its name, our field (and layer), its checkpoint shape, a converter."""

    name: str
    field: str
    layer: int | None
    ckpt_shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    name: str
    forward: Callable  # (params, config, tokens, positions, kv_caches, meta, *, attn_impl)
    compute_logits: Callable  # (params, hidden [N, E]) -> f32[N, V]
    init_params: Callable  # (config, key, dtype) -> params
    assemble: Callable  # (config, top: dict, per_layer: list[dict]) -> params
    checkpoint_specs: Callable  # (config, fmt) -> list[TensorSpec]
    ignored_tensors: tuple[str, ...]  # checkpoint name suffixes that may be present and unused
    param_axes: dict  # field name -> logical axis names


def get_family(name: str) -> ModelFamily:
    # Imported here: family modules import TensorSpec from this module.
    from jaxinfer.models import llama, llama_names

    families = {
        "llama": ModelFamily(
            name="llama", forward=llama.forward, compute_logits=llama.compute_logits,
            init_params=llama.init_params, assemble=llama.assemble,
            checkpoint_specs=llama_names.checkpoint_specs, ignored_tensors=llama_names.IGNORED,
            param_axes=llama.PARAM_AXES),
    }
    if name not in families:
        raise ValueError(f"unknown model family {name!r}; known: {sorted(families)}")
    return families[name]
