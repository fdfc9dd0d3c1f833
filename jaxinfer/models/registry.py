"""Model families by name: the typed record of each one's model code, for the loader and the worker.

A `ModelFamily` is model code only: a forward pass over the ragged batch, the LM head, random
init, how to assemble its parameter tree from loaded arrays, its checkpoint name map
(TensorSpecs) and the logical axes of every parameter (for sharding). The engine reaches a model
only through this record.

    get_family(name) ─► the family's FamilySpec (jaxinfer.config.families: what it serves, how its
                        config is read; no JAX) ─► spec.model(), called once: imports the model
                        code and returns this record

So a family is its folder, jaxinfer/models/<family>/ (__init__.py: its FamilySpec; config.py,
model.py, names.py), and one entry in families.BUILTIN_FAMILIES; a family defined outside the
package (a plug-in, a test) is added with `register_family`, without editing the package.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Protocol

import jax
from jax.sharding import Mesh
from jax.typing import DTypeLike

from jaxinfer.config import ModelConfig, families
from jaxinfer.config.families import FamilySpec
from jaxinfer.models.layers import AttentionMetadata, Fields, KVCache
from jaxinfer.models.specs import TensorSpec

KVCaches = tuple[KVCache, ...]  # one [P, page, 2K, D] array (or quantized cache) per layer


class ModelParams(Protocol):
    """What code outside a family reads of its parameter pytree (a flax.struct dataclass)."""

    @property
    def embed(self) -> jax.Array: ...  # [V, E]; its dtype is the model's dtype


# The protocols of a family's functions take its own parameter tree `P` (LlamaParams, ...).


class ForwardFn[P: ModelParams](Protocol):
    def __call__(
        self,
        params: P,
        config: ModelConfig,
        tokens: jax.Array,
        positions: jax.Array,
        kv_caches: KVCaches,
        meta: AttentionMetadata[jax.Array],
        *,
        attn_impl: str = "auto",
    ) -> tuple[jax.Array, KVCaches]:
        """tokens, positions i32[T] -> (hidden [T, E] after the final norm, new caches)."""


class TickFn[P: ModelParams](Protocol):
    def __call__(
        self,
        params: P,
        config: ModelConfig,
        tokens: jax.Array,
        positions: jax.Array,
        kv_caches: KVCaches,
        meta: AttentionMetadata[jax.Array],
        inflight: jax.Array,
        *,
        attn_impl: str = "auto",
    ) -> tuple[jax.Array, KVCaches, jax.Array]:
        """One pipeline tick (models/ticks.py): tokens i32[T], positions i32[S, T] -> (the exiting
        batch's hidden [T, E], new caches, the activations in flight)."""


class LogitsFn[P: ModelParams](Protocol):
    def __call__(self, params: P, hidden: jax.Array) -> jax.Array:
        """hidden [N, E] -> logits f32[N, V]."""


class InitParamsFn[P: ModelParams](Protocol):
    def __call__(self, config: ModelConfig, key: jax.Array, dtype: DTypeLike = ..., scale: float = ...) -> P:
        """Random parameters of the config's shapes (tests and benchmarks)."""


class AssembleFn[P: ModelParams](Protocol):
    def __call__(self, config: ModelConfig, top: Fields, per_layer: list[Fields]) -> P:
        """The parameter tree from loaded arrays keyed by field name (it may empty `per_layer`
        dicts as it goes, freeing arrays it has fused)."""


class CheckpointSpecsFn(Protocol):
    def __call__(self, config: ModelConfig, fmt: str) -> list[TensorSpec]:
        """Every tensor a checkpoint of format `fmt` ("hf" | "gguf" | "ours") must hold, in load order."""


@dataclasses.dataclass(frozen=True)
class ModelFamily[P: ModelParams]:
    name: str
    forward: ForwardFn[P]
    compute_logits: LogitsFn[P]
    init_params: InitParamsFn[P]
    assemble: AssembleFn[P]
    checkpoint_specs: CheckpointSpecsFn
    ignored_tensors: tuple[str, ...]  # checkpoint name suffixes that may be present and unused
    param_axes: Mapping[str, tuple[str, ...]]  # field name -> logical axis names
    # Linear weights weight-only quantization may replace (jaxinfer.quant): field -> input axes.
    linear_inputs: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    traits: tuple[str, ...] = ()  # what every model of the family does (for `jaxinfer info`)
    # (params, mesh or None) -> params in the layout the step computes with there (the worker's).
    compute_layout: Callable[[P, Mesh | None], P] | None = None
    # The forward as one tick of a pipeline with a batch on every stage (models/ticks.py);
    # None: staged engines of the family take one batch through the stages at a time.
    tick: TickFn[P] | None = None


_LOADED: dict[str, tuple[FamilySpec, ModelFamily]] = {}  # name -> (its spec, the record spec.model made)


def register_family(spec: FamilySpec) -> None:
    """Adds a model family from outside the package: its config.json model_types (and GGUF
    architectures, if any) are served by it from now on, in `LLM(path)`, the loader, `convert`.
    `spec.model` imports its model code on first use and returns its ModelFamily. A ValueError
    names a family name or model_type already taken."""
    families.register(spec)


def features(config: ModelConfig) -> list[str]:
    """What this model does beyond a plain decoder, in words: its family's traits, then the
    config's choices (attention pattern, rope, caps, experts)."""
    c = config
    out = list(get_family(c.family).traits)
    windows = [c.layer_window(i) for i in range(c.num_layers)]
    sliding = sum(w is not None for w in windows)
    if sliding:
        where = "every layer" if sliding == c.num_layers else f"{sliding} of {c.num_layers} layers"
        out.append(f"sliding window {c.sliding_window} on {where}")
    scaling = f", {c.rope_scaling.rope_type} scaling x{c.rope_scaling.factor:g}" if c.rope_scaling else ""
    local = f" (sliding layers: base {c.rope_local_theta:g})" if c.rope_local_theta and sliding else ""
    out.append(f"rope base {c.rope_theta:g}{scaling}{local}")
    flags = [
        (c.qk_norm, "QK-norm"),
        (c.qkv_bias, "q/k/v biases"),
        (c.tie_word_embeddings, "tied LM head"),
        (c.query_pre_attn_scalar, "scores scaled by {query_pre_attn_scalar:g}^-1/2"),
        (c.attn_logit_softcap, "attention soft cap {attn_logit_softcap:g}"),
        (c.final_logit_softcap, "final logit soft cap {final_logit_softcap:g}"),
        (c.num_experts, "{num_experts} experts, top-{num_experts_per_tok}"),
    ]
    fields = dataclasses.asdict(c)
    return out + [text.format(**fields) for on, text in flags if on]


def get_family(name: str) -> ModelFamily:
    """The model code of family `name` (a ValueError lists the known families)."""
    spec = families.family_spec(name)
    loaded = _LOADED.get(name)
    if loaded is None or loaded[0] is not spec:
        family = spec.model()
        if not isinstance(family, ModelFamily) or family.name != name:
            raise ValueError(
                f"model family {name!r}: its model() returned {family!r}, not a ModelFamily named {name!r}"
            )
        loaded = _LOADED[name] = (spec, family)
    return loaded[1]
