"""ModelConfig: the shapes and numerics a model family needs, nothing about serving.

Read from an HF `config.json` or GGUF metadata by sources.py (the shared fields, then the
family's own); `to_hf_dict` runs the other way: the shared keys here, then the family's.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from jaxinfer.config import families
from jaxinfer.config.errors import ConfigError
from jaxinfer.config.sources import RopeScaling, check_layer_types, gguf_fields, hf_fields, is_sliding_layer

__all__ = ["ConfigError", "ModelConfig", "RopeScaling"]


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
        return cls(**hf_fields(cfg))

    @classmethod
    def from_hf_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"model config not found: {path}")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
        return cls(**hf_fields(cfg, source=str(path)))

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
        cfg = cls(**gguf_fields(meta, has_output_weight, tensor_names))
        if rope_freq_factors is None:
            return cfg
        if len(rope_freq_factors) != cfg.head_dim // 2:
            raise ConfigError(
                f"GGUF rope_freqs has {len(rope_freq_factors)} factors; head_dim "
                f"{cfg.head_dim} needs {cfg.head_dim // 2}"
            )
        return dataclasses.replace(cfg, rope_freq_factors=tuple(float(f) for f in rope_freq_factors))
