"""The two sources of a model config, read into ModelConfig's fields: an HF `config.json` and
GGUF metadata; rope settings, and the layer types of models that mix sliding-window and global
attention layers.

    config.json / GGUF metadata ─► the family serving its model_type / architecture (families.py)
      ─► the shared fields, read here (shapes, norms, rope, biases, special ids)
      ─► the family's own fields, read by the family (jaxinfer/models/<family>/config.py), which
         may also read a shared field its own way ─► ModelConfig(**fields) (model.py)

Errors name the missing or unsupported field, since a wrong config is a user's mistake.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

from jaxinfer.config import families
from jaxinfer.config.errors import ConfigError, require

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SLIDING, FULL = "sliding_attention", "full_attention"  # HF layer_types


def pattern_layer_types(num_layers: int, period: int) -> tuple[str, ...]:
    """Every `period`-th layer global (layers period-1, 2*period-1, ...), the others sliding."""
    return tuple(FULL if (i + 1) % period == 0 else SLIDING for i in range(num_layers))


def is_sliding_layer(types: tuple[str, ...], i: int) -> bool:
    """Layer i is a local (sliding-window) layer: by its layer type, or every layer where no
    types are listed."""
    return not types or types[i] == SLIDING


def check_layer_types(types: tuple[str, ...], num_layers: int, source: str) -> None:
    if types and (len(types) != num_layers or not set(types) <= {SLIDING, FULL}):
        raise ConfigError(
            f"{source}: layer_types={list(types)!r} must give each of the {num_layers} layers {SLIDING!r} or {FULL!r}"
        )


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    rope_type: str  # "linear" | "llama3"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def _split(hidden: int, heads: int, source: str) -> int:
    """head_dim when the config gives none: hidden / heads, which must divide."""
    if heads < 1 or hidden % heads:
        raise ConfigError(f"{source}: hidden size {hidden} is not divisible by {heads} attention heads")
    return hidden // heads


def _as_id_tuple(value: Any) -> tuple[int, ...]:  # a config.json value: an id, a list of them, or null
    return () if value is None else tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))


def rope_from_hf(cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
    """{rope_theta, rope_scaling} of a config.json's rope settings. transformers >= 5 writes
    rope_parameters {rope_theta, rope_type, ...}; older checkpoints a top-level rope_theta and an
    optional rope_scaling {type|rope_type, factor, ...}."""
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise ConfigError(f"{source}: missing required field 'rope_theta' (or rope_parameters.rope_theta)")
    scaling = cfg.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"{source}: unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return dict(rope_theta=float(theta), rope_scaling=None)
    factor = require(scaling, "factor", f"{source} rope_scaling")
    return dict(
        rope_theta=float(theta),
        rope_scaling=RopeScaling(
            rope_type=rope_type,
            factor=float(factor),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
        ),
    )


def hf_fields(cfg: Mapping[str, Any], source: str = "config.json") -> dict[str, Any]:
    """ModelConfig's fields from a config.json: the shared ones here, then the family's own."""
    model_type = require(cfg, "model_type", source)
    spec = families.spec_for_hf(model_type, source)
    req = lambda key: require(cfg, key, source)  # noqa: E731
    hidden, heads = int(req("hidden_size")), int(req("num_attention_heads"))
    head_dim = cfg.get("head_dim") or _split(hidden, heads, source)
    attention_bias = bool(cfg.get("attention_bias", False))
    fields = dict(
        model_type=model_type,
        family=spec.name,
        vocab_size=int(req("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(req("intermediate_size")),
        num_layers=int(req("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(req("rms_norm_eps")),
        max_position_embeddings=int(req("max_position_embeddings")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_as_id_tuple(cfg.get("eos_token_id")),
        rope_freq_factors=tuple(float(f) for f in cfg["rope_freq_factors"]) if cfg.get("rope_freq_factors") else None,
    )
    own = spec.read_hf(cfg, fields, source)
    if "rope_theta" not in own:
        fields.update(rope_from_hf(cfg, source))
    return {**fields, **own}


def gguf_fields(
    meta: Mapping[str, Any], has_output_weight: bool, tensor_names: Collection[str] | None
) -> dict[str, Any]:
    """ModelConfig's fields from GGUF metadata: the shared ones here, then the family's own."""
    source = "GGUF metadata"
    arch = require(meta, "general.architecture", source)
    spec, model_type = families.spec_for_gguf(meta, arch, source)
    req = lambda key: require(meta, f"{arch}.{key}", source)  # noqa: E731
    hidden, heads = int(req("embedding_length")), int(req("attention.head_count"))
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(require(meta, "tokenizer.ggml.tokens", source))
    scaling = None
    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        scaling = RopeScaling("linear", float(req("rope.scaling.factor")))
    elif scaling_type not in (None, "none"):
        raise ConfigError(f"{source}: unsupported {arch}.rope.scaling.type {scaling_type!r}")
    window = meta.get(f"{arch}.attention.sliding_window")
    fields = dict(
        model_type=model_type,
        family=spec.name,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(req("feed_forward_length")),
        num_layers=int(req("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=int(meta.get(f"{arch}.attention.key_length") or _split(hidden, heads, source)),
        rms_norm_eps=float(req("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(req("context_length")),
        tie_word_embeddings=not has_output_weight,
        sliding_window=int(window) if window else None,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_as_id_tuple(meta.get("tokenizer.ggml.eos_token_id")),
    )
    fields.update(spec.read_gguf(meta, arch, fields, tensor_names, source))
    return fields
