"""The Gemma family's own config fields (config/model.py reads the shared ones, then these).

Which layers slide (HF `layer_types`, or the older `sliding_window_pattern`: every n-th layer
global), the sliding layers' rope base, the attention scale `query_pre_attn_scalar`, tanh soft
caps on attention scores (Gemma 2) and final logits, Gemma 3's QK-norm; GELU(tanh) MLPs.
Gemma 3 keeps per-layer-type rope settings in `rope_parameters.{full_attention,
sliding_attention}` (transformers 5) or as rope_theta / rope_scaling / rope_local_base_freq
(older files), so this family reads the rope itself. A GGUF states no pattern, local base or
scale: llama.cpp's fixed values are used (every 6th Gemma 3 layer global, every 2nd Gemma 2 layer;
local base 10000; scale head_dim, hidden / heads for the 27B).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

from jaxinfer.config.errors import ConfigError, require
from jaxinfer.config.sources import FULL, SLIDING, check_layer_types, pattern_layer_types, rope_from_hf

if TYPE_CHECKING:
    from jaxinfer.config import ModelConfig  # the config module reads these at its import

ACTIVATION = "gelu_pytorch_tanh"
# llama.cpp: Gemma 3 slides all layers but every 6th, Gemma 2 every other one; local rope base 10000.
_GGUF_PATTERN = {"gemma2": 2, "gemma3": 6}
_GGUF_LOCAL_THETA = {"gemma3": 10000.0}
_GGUF_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # the 27B models scale scores by hidden / heads


def rope_config(cfg: Mapping[str, Any]) -> tuple[Mapping[str, Any], float | None]:
    """(the global layers' rope settings in the flat form `rope_from_hf` parses, the sliding
    layers' rope base or None when they share the global rope)."""
    params = cfg.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:  # transformers 5: one rope per layer type
        local = (params.get(SLIDING) or {}).get("rope_theta")
        return {"rope_parameters": {"rope_theta": 1_000_000.0, **(params.get(FULL) or {})}}, local
    if cfg.get("model_type") == "gemma3_text":
        flat = {"rope_theta": 1_000_000.0, **cfg}
        return flat, float(cfg.get("rope_local_base_freq") or 10_000.0)
    return {"rope_theta": 10_000.0, **cfg}, None


def _layer_types(cfg: Mapping[str, Any], model_type: str, source: str) -> tuple[str, ...]:
    num_layers = int(require(cfg, "num_hidden_layers", source))
    types = cfg.get("layer_types")
    if not types:
        default = 6 if model_type == "gemma3_text" else 2
        period = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or default
        types = pattern_layer_types(num_layers, int(period))
    types = tuple(types)
    check_layer_types(types, num_layers, source)
    return types


def read_hf(cfg: Mapping[str, Any], shared: Mapping[str, Any], source: str) -> dict[str, Any]:
    model_type = shared["model_type"]
    rope_cfg, local_theta = rope_config(cfg)
    rope = rope_from_hf(rope_cfg, source)
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or ACTIVATION
    if activation != ACTIVATION:
        raise ConfigError(f"{source}: unsupported hidden_activation {activation!r}; supported: {ACTIVATION!r}")
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError(f"{source}: use_bidirectional_attention=True (an embedding model) is not supported")
    types = _layer_types(cfg, model_type, source)
    window = cfg.get("sliding_window") if SLIDING in types else None
    if SLIDING in types and not window:
        raise ConfigError(f"{source}: layer_types has sliding layers but sliding_window={window!r}")
    softcaps = {k: cfg.get(k) for k in ("attn_logit_softcapping", "final_logit_softcapping")}
    if model_type == "gemma3_text":
        softcaps["attn_logit_softcapping"] = None  # Gemma 3's attention never applies it
    return dict(
        rope,
        rope_local_theta=None if local_theta is None else float(local_theta),
        layer_types=types,
        sliding_window=int(window) if window else None,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or 256),
        attn_logit_softcap=_positive_or_none(softcaps["attn_logit_softcapping"], "attn_logit_softcapping", source),
        final_logit_softcap=_positive_or_none(softcaps["final_logit_softcapping"], "final_logit_softcapping", source),
        qk_norm=model_type == "gemma3_text",
    )


def read_gguf(
    meta: Mapping[str, Any], arch: str, shared: Mapping[str, Any], tensor_names: Collection[str] | None, source: str
) -> dict[str, Any]:
    """The Gemma fields of GGUF metadata, with llama.cpp's fixed values where the file is silent."""
    num_layers = shared["num_layers"]
    window = meta.get(f"{arch}.attention.sliding_window")
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", _GGUF_PATTERN[arch])
    if isinstance(pattern, (list, tuple)):  # per layer: True where the layer slides
        types = tuple(SLIDING if flag else FULL for flag in pattern)
    else:
        types = pattern_layer_types(num_layers, int(pattern))
    check_layer_types(types, num_layers, source)
    local = meta.get(f"{arch}.rope.freq_base_swa", _GGUF_LOCAL_THETA.get(arch))
    hidden, heads = shared["hidden_size"], shared["num_heads"]
    scalar = hidden / heads if num_layers == _GGUF_27B_LAYERS[arch] else shared["head_dim"]
    caps = (
        {
            "attn": meta.get("gemma2.attn_logit_softcapping", 50.0),
            "final": meta.get("gemma2.final_logit_softcapping", 30.0),
        }
        if arch == "gemma2"
        else {"attn": None, "final": meta.get(f"{arch}.final_logit_softcapping")}
    )
    return dict(
        layer_types=types,
        sliding_window=int(window) if window and SLIDING in types else None,
        rope_local_theta=None if local is None else float(local),
        query_pre_attn_scalar=float(scalar),
        qk_norm=arch == "gemma3",
        attn_logit_softcap=_positive_or_none(caps["attn"], "attn_logit_softcapping", source),
        final_logit_softcap=_positive_or_none(caps["final"], "final_logit_softcapping", source),
    )


def to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Gemma keys of a config.json for `config` (a gemma-family ModelConfig)."""
    cfg: dict[str, Any] = {
        "layer_types": list(config.layer_types),
        "query_pre_attn_scalar": config.query_pre_attn_scalar,
        "attn_logit_softcapping": config.attn_logit_softcap,
        "final_logit_softcapping": config.final_logit_softcap,
        "hidden_activation": ACTIVATION,
        "sliding_window": config.sliding_window,
    }
    if config.model_type == "gemma3_text":
        full = {"rope_theta": config.rope_theta, "rope_type": "default"}
        if config.rope_scaling is not None:
            full.update(rope_type=config.rope_scaling.rope_type, factor=config.rope_scaling.factor)
        local = {"rope_theta": config.rope_local_theta or config.rope_theta, "rope_type": "default"}
        cfg["rope_parameters"] = {FULL: full, SLIDING: local}
    return cfg


def _positive_or_none(value: Any, name: str, source: str) -> float | None:  # value: a JSON number
    if value is None:
        return None
    if not float(value) > 0:
        raise ConfigError(f"{source}: {name}={value!r} must be a positive number or null")
    return float(value)
