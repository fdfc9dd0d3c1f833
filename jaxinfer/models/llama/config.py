"""The Llama family's own config fields (config/model.py reads the shared ones, then these).

  Qwen2           q/k/v biases always, no output bias (HF: attention_bias is then o's only)
  Qwen3           QK-norm: an RMSNorm over head_dim on every query and key head, before RoPE
  Mistral, Qwen   one sliding window for every layer, or none (`sliding_window` says which)

Every model of the family is SiLU-gated. The MoE family reads these too, for its attention.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

from jaxinfer.config.errors import ConfigError

if TYPE_CHECKING:
    from jaxinfer.config import ModelConfig  # the config module reads these at its import

QK_NORM_TYPES = ("qwen3", "qwen3_moe")


def sliding_window(cfg: Mapping[str, Any], model_type: str, source: str) -> int | None:
    """Mistral slides every layer; Qwen2/3 only with use_sliding_window, and Qwen3 then only the
    layers its layer_types call "sliding_attention" (by default those from max_window_layers on):
    one window for the whole model holds only when every layer or none slides."""
    window = cfg.get("sliding_window")
    if not window or (model_type in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window", False)):
        return None
    if model_type == "qwen3":
        first = int(cfg.get("max_window_layers", 28))
        types = cfg.get("layer_types") or [
            "sliding_attention" if i >= first else "full_attention"
            for i in range(int(cfg.get("num_hidden_layers") or 0))
        ]
        sliding = sum(t == "sliding_attention" for t in types)
        if 0 < sliding < len(types):
            raise ConfigError(
                f"{source}: sliding_window in {sliding} of {len(types)} layers "
                "(use_sliding_window with max_window_layers / layer_types) is not supported"
            )
        if not sliding:
            return None
    return int(window)


def read_hf(cfg: Mapping[str, Any], shared: Mapping[str, Any], source: str) -> dict[str, Any]:
    model_type = shared["model_type"]
    hidden_act = cfg.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ConfigError(f"{source}: unsupported hidden_act {hidden_act!r}; supported: 'silu'")
    attention_bias = bool(cfg.get("attention_bias", False))
    return dict(
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=model_type != "qwen2" and attention_bias,
        qk_norm=model_type in QK_NORM_TYPES,
        sliding_window=sliding_window(cfg, model_type, source),
    )


def read_gguf(
    meta: Mapping[str, Any], arch: str, shared: Mapping[str, Any], tensor_names: Collection[str] | None, source: str
) -> dict[str, Any]:
    return dict(qkv_bias=arch == "qwen2", qk_norm=shared["model_type"] in QK_NORM_TYPES)


def to_hf(config: ModelConfig) -> dict[str, Any]:
    """Qwen2's attention_bias names the output bias (its q/k/v biases go without saying)."""
    return {"attention_bias": config.o_bias} if config.model_type == "qwen2" else {}


def serves_gguf(meta: Mapping[str, Any], arch: str) -> bool:
    """llama.cpp stores Mixtral as architecture "llama" with experts: that file is the MoE family's."""
    return arch != "llama" or not meta.get("llama.expert_count")
