"""Model families by name, and the typed record every family provides to the loader and runner.

A family is model code only: a forward pass over the ragged batch, the LM head, random init, how
to assemble its parameter tree from loaded arrays, its checkpoint name map (TensorSpecs) and the
logical axes of every parameter (for sharding). The engine reaches a model only through this
record, so a new family is a file pair (forward + names) and one entry in `_FAMILIES`.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Protocol

import jax
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.models import llama, llama_names, moe, moe_names
from jaxinfer.models.layers import AttentionMetadata
from jaxinfer.models.specs import TensorSpec

KVCaches = tuple[jax.Array, ...]  # one [P, page, 2K, D] array per layer


class ModelParams(Protocol):
    """What code outside a family reads of its parameter pytree (a flax.struct dataclass)."""

    embed: jax.Array  # [V, E]; its dtype is the model's dtype


class ForwardFn(Protocol):
    def __call__(self, params: ModelParams, config: ModelConfig, tokens: jax.Array,
                 positions: jax.Array, kv_caches: KVCaches, meta: AttentionMetadata, *,
                 attn_impl: str = "auto") -> tuple[jax.Array, KVCaches]:
        """tokens, positions i32[T] -> (hidden [T, E] after the final norm, new caches)."""


class LogitsFn(Protocol):
    def __call__(self, params: ModelParams, hidden: jax.Array) -> jax.Array:
        """hidden [N, E] -> logits f32[N, V]."""


class InitParamsFn(Protocol):
    def __call__(self, config: ModelConfig, key: jax.Array, dtype: np.dtype | type = ...,
                 scale: float = ...) -> ModelParams:
        """Random parameters of the config's shapes (tests and benchmarks)."""


class AssembleFn(Protocol):
    def __call__(self, config: ModelConfig, top: dict[str, jax.Array],
                 per_layer: list[dict[str, jax.Array]]) -> ModelParams:
        """The parameter tree from loaded arrays keyed by field name (it may empty `per_layer`
        dicts as it goes, freeing arrays it has fused)."""


class CheckpointSpecsFn(Protocol):
    def __call__(self, config: ModelConfig, fmt: str) -> list[TensorSpec]:
        """Every tensor a checkpoint of format `fmt` ("hf" | "gguf" | "ours") must hold, in load order."""


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    name: str
    forward: ForwardFn
    compute_logits: LogitsFn
    init_params: InitParamsFn
    assemble: AssembleFn
    checkpoint_specs: CheckpointSpecsFn
    ignored_tensors: tuple[str, ...]  # checkpoint name suffixes that may be present and unused
    param_axes: Mapping[str, tuple[str, ...]]  # field name -> logical axis names
    # Linear weights weight-only quantization may replace (jaxinfer.quant): field -> input axes.
    linear_inputs: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)


_FAMILIES: dict[str, ModelFamily] = {
    "llama": ModelFamily(
        name="llama", forward=llama.forward, compute_logits=llama.compute_logits,
        init_params=llama.init_params, assemble=llama.assemble,
        checkpoint_specs=llama_names.checkpoint_specs, ignored_tensors=llama_names.IGNORED,
        param_axes=llama.PARAM_AXES, linear_inputs=llama.LINEAR_INPUTS),
    "moe": ModelFamily(
        name="moe", forward=moe.forward, compute_logits=moe.compute_logits,
        init_params=moe.init_params, assemble=moe.assemble,
        checkpoint_specs=moe_names.checkpoint_specs, ignored_tensors=moe_names.IGNORED,
        param_axes=moe.PARAM_AXES),
}


def get_family(name: str) -> ModelFamily:
    if name not in _FAMILIES:
        raise ValueError(f"unknown model family {name!r}; known: {sorted(_FAMILIES)}")
    return _FAMILIES[name]
