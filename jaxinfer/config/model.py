"""Model configuration, read from an HF `config.json` or from GGUF metadata.

Both sources end in one `ModelConfig`: the shapes and numerics a model family needs, nothing about
serving. Errors name the missing or unsupported field, since a wrong config is a user's mistake.

    config.json / GGUF metadata ─► the family serving its model_type / architecture (families.py)
      ─► the shared fields, read here (shapes, norms, rope, biases, special ids)
      ─► the family's own fields, read by the family (jaxinfer/models/<family>/config.py), which
         may also read a shared field its own way ─► ModelConfig

`to_hf_dict` runs the other way: the shared keys here, then the family's.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from jaxinfer.config import families
from jaxinfer.config.errors import ConfigError, require

__all__ = ["ConfigError", "ModelConfig", "RopeScaling"]

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


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str  # checkpoint's own name: "llama", "mistral", "qwen2", "qwen3", "mixtral", ...
    family: str  # model code that runs it (families.py): "llama", "moe", "gemma", or one registered
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm (weights [D]) on each query and key head before RoPE
    sliding_window: int | None = None
    rope_freq_factors: tuple[float, ...] | None = None  # GGUF rope_freqs: inv_freq divisors [D/2]
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixtures of experts (family "moe"): a token's MLP is the router-weighted sum of its top-k experts'
    # (width moe_intermediate_size); layers `is_moe_layer` rejects keep a dense MLP (intermediate_size).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Gemma 2 / 3 (family "gemma"; models/gemma/config.py): HF layer_types ("sliding_attention" layers use
    # sliding_window, "full_attention" ones see everything; empty: all use sliding_window), the
    # sliding layers' rope base (None: rope_theta; global layers keep rope_scaling), scores scaled
    # by query_pre_attn_scalar ** -0.5 (None: head_dim), tanh soft caps on scores and final logits.
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None

    def layer_window(self, i: int) -> int | None:
        """Layer i's sliding window; None where it attends to the whole context."""
        return self.sliding_window if is_sliding_layer(self.layer_types, i) else None

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"ModelConfig.{name}={value!r} must be a positive integer")
        check_layer_types(self.layer_types, self.num_layers, "ModelConfig")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )

    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        return _from_hf(cfg)

    @classmethod
    def from_hf_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"model config not found: {path}")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
        return _from_hf(cfg, source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        """An HF config.json for this config, which `from_hf_dict` reads back to an equal config
        (a GGUF's rope_freqs travel as "rope_freq_factors", a key transformers ignores)."""
        rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope.update(dataclasses.asdict(self.rope_scaling))
        spec = families.family_spec(self.family)
        cfg = {
            "model_type": self.model_type,
            "architectures": [spec.hf_architectures[self.model_type]],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias,
            "mlp_bias": self.mlp_bias,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
        }
        if self.sliding_window is not None:
            # max_window_layers 0: Qwen2/3 slide every layer from it on, as this config does.
            cfg.update(sliding_window=self.sliding_window, use_sliding_window=True, max_window_layers=0)
        if self.rope_freq_factors is not None:
            cfg["rope_freq_factors"] = list(self.rope_freq_factors)
        cfg.update(spec.to_hf(self))
        return cfg

    @classmethod
    def from_gguf_metadata(
        cls,
        meta: Mapping[str, Any],
        *,
        has_output_weight: bool = True,
        rope_freq_factors: tuple[float, ...] | None = None,
        tensor_names: Collection[str] | None = None,
    ) -> ModelConfig:
        """`rope_freq_factors`: the GGUF's rope_freqs tensor, where llama.cpp stores llama3-style
        rope scaling as one divisor per frequency. `tensor_names` (the file's): whether an LM head
        is stored, and which layers of a mixture of experts route."""
        if tensor_names is not None:
            has_output_weight = "output.weight" in tensor_names
        cfg = _from_gguf(meta, has_output_weight, tensor_names)
        if rope_freq_factors is None:
            return cfg
        if len(rope_freq_factors) != cfg.head_dim // 2:
            raise ConfigError(
                f"GGUF rope_freqs has {len(rope_freq_factors)} factors; head_dim "
                f"{cfg.head_dim} needs {cfg.head_dim // 2}"
            )
        return dataclasses.replace(cfg, rope_freq_factors=tuple(float(f) for f in rope_freq_factors))


def _split(hidden: int, heads: int, source: str) -> int:
    """head_dim when the config gives none: hidden / heads, which must divide."""
    if heads < 1 or hidden % heads:
        raise ConfigError(f"{source}: hidden size {hidden} is not divisible by {heads} attention heads")
    return hidden // heads


def _as_id_tuple(value) -> tuple[int, ...]:
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


def _from_hf(cfg: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
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
    return ModelConfig(**{**fields, **own})


def _from_gguf(meta: Mapping[str, Any], has_output_weight: bool, tensor_names: Collection[str] | None) -> ModelConfig:
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
    return ModelConfig(**fields)
