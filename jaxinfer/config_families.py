"""The family-specific parts of reading a model configuration (config.py reads the common ones).

Each function maps an HF `config.json` dict or GGUF metadata to extra `ModelConfig` keyword
arguments for one family, or back to HF keys; errors are `ConfigError`s naming the bad field.

  Mistral, Qwen2 / Qwen3    one sliding window for every layer, or none
  MoE (Mixtral, Qwen3-MoE)  experts, top-k, renormalisation, which layers route (a GGUF: the
                            layers with a router tensor)
  Gemma 2 / Gemma 3         which layers slide (HF `layer_types`, or the older
                            `sliding_window_pattern`: every n-th layer global), the sliding layers'
                            rope base, the attention scale `query_pre_attn_scalar`, tanh soft caps
                            on attention scores (Gemma 2) and final logits; GELU(tanh) MLPs.
                            Gemma 3 keeps per-layer-type rope settings in
                            `rope_parameters.{full_attention, sliding_attention}` (transformers 5)
                            or as rope_theta / rope_scaling / rope_local_base_freq (older files).
                            A GGUF states no pattern, local base or scale: llama.cpp's fixed
                            values are used (every 6th Gemma 3 layer global, every 2nd Gemma 2
                            layer; local base 10000; scale head_dim, hidden / heads for the 27B).
"""
from __future__ import annotations

from typing import Any, Collection, Mapping

SLIDING, FULL = "sliding_attention", "full_attention"
GEMMA_HF_TYPES = ("gemma2", "gemma3_text")
GEMMA_ACTIVATION = "gelu_pytorch_tanh"
# llama.cpp: Gemma 3 slides all layers but every 6th, Gemma 2 every other one; local rope base 10000.
_GGUF_PATTERN = {"gemma2": 2, "gemma3": 6}
_GGUF_LOCAL_THETA = {"gemma3": 10000.0}
_GGUF_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # the 27B models scale scores by hidden / heads


class ConfigError(ValueError):
    """A model configuration is missing a field or asks for something unsupported."""


def require(cfg: Mapping[str, Any], key: str, source: str):
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"{source}: missing required field {key!r}")
    return cfg[key]


def moe_from_hf(cfg: Mapping[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """Mixtral routes every layer and renormalises its top-k always; Qwen3-MoE says which layers
    route (mlp_only_layers, decoder_sparse_step) and whether to renormalise."""
    experts, top_k = cfg.get("num_experts") or cfg.get("num_local_experts"), require(cfg, "num_experts_per_tok", source)
    if not experts or not 1 <= int(top_k) <= int(experts):
        raise ConfigError(f"{source}: num_experts_per_tok={top_k} must be in 1..num_experts={experts}")
    return dict(num_experts=int(experts), num_experts_per_tok=int(top_k),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", model_type == "mixtral")),
                decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
                mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()))


# GGUF architectures named apart from HF's model_type; llama.cpp stores Mixtral as "llama" with experts.
_GGUF_MODEL_TYPES = {"qwen3moe": "qwen3_moe"}


def gguf_model_type(meta: Mapping[str, Any], arch: str) -> str:
    if arch == "llama" and meta.get("llama.expert_count"):
        return "mixtral"
    return _GGUF_MODEL_TYPES.get(arch, arch)


def moe_from_gguf(meta: Mapping[str, Any], arch: str, num_layers: int, tensor_names: Collection[str] | None,
                  source: str) -> dict[str, Any]:
    """llama.cpp's expert keys: {arch}.expert_count, expert_used_count and expert_feed_forward_length
    (Mixtral's experts have the feed_forward_length); the top k renormalised unless
    {arch}.expert_weights_norm is false (llama.cpp renormalises both families). A GGUF states no
    dense layers: a layer without a router tensor (blk.N.ffn_gate_inp) keeps a dense MLP."""
    experts, top_k = int(meta[f"{arch}.expert_count"]), int(require(meta, f"{arch}.expert_used_count", source))
    if not 1 <= top_k <= experts:
        raise ConfigError(f"{source}: {arch}.expert_used_count={top_k} must be in 1..expert_count={experts}")
    width = meta.get(f"{arch}.expert_feed_forward_length") or require(meta, f"{arch}.feed_forward_length", source)
    dense = () if tensor_names is None else tuple(
        i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names)
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=int(width),
                norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", True)), mlp_only_layers=dense)


def llama_sliding_window(cfg: Mapping[str, Any], model_type: str, source: str) -> int | None:
    """Mistral slides every layer; Qwen2/3 only with use_sliding_window, and Qwen3 then only the
    layers its layer_types call "sliding_attention" (by default those from max_window_layers on):
    one window for the whole model holds only when every layer or none slides."""
    window = cfg.get("sliding_window")
    if not window or (model_type in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window", False)):
        return None
    if model_type == "qwen3":
        first = int(cfg.get("max_window_layers", 28))
        types = cfg.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                           for i in range(int(cfg.get("num_hidden_layers") or 0))]
        sliding = sum(t == "sliding_attention" for t in types)
        if 0 < sliding < len(types):
            raise ConfigError(f"{source}: sliding_window in {sliding} of {len(types)} layers "
                              "(use_sliding_window with max_window_layers / layer_types) is not supported")
        if not sliding:
            return None
    return int(window)


def pattern_layer_types(num_layers: int, period: int) -> tuple[str, ...]:
    """Every `period`-th layer global (layers period-1, 2*period-1, ...), the others sliding."""
    return tuple(FULL if (i + 1) % period == 0 else SLIDING for i in range(num_layers))


def is_sliding_layer(types: tuple[str, ...], i: int) -> bool:
    """Layer i is a local (sliding-window) layer: by its layer type, or every layer where no
    types are listed."""
    return not types or types[i] == SLIDING


def check_layer_types(types: tuple[str, ...], num_layers: int, source: str) -> None:
    if types and (len(types) != num_layers or not set(types) <= {SLIDING, FULL}):
        raise ConfigError(f"{source}: layer_types={list(types)!r} must give each of the {num_layers} layers "
                          f"{SLIDING!r} or {FULL!r}")


def gemma_rope_config(cfg: Mapping[str, Any]) -> tuple[Mapping[str, Any], float | None]:
    """(the global layers' rope settings in the flat form config.py parses, the sliding layers'
    rope base or None when they share the global rope)."""
    params = cfg.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:  # transformers 5: one rope per layer type
        local = (params.get(SLIDING) or {}).get("rope_theta")
        return {"rope_parameters": {"rope_theta": 1_000_000.0, **(params.get(FULL) or {})}}, local
    if cfg.get("model_type") == "gemma3_text":
        flat = {"rope_theta": 1_000_000.0, **cfg}
        return flat, float(cfg.get("rope_local_base_freq") or 10_000.0)
    return {"rope_theta": 10_000.0, **cfg}, None


def gemma_from_hf(cfg: Mapping[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """The Gemma fields of an HF config (the rope comes from `gemma_rope_config`)."""
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or GEMMA_ACTIVATION
    if activation != GEMMA_ACTIVATION:
        raise ConfigError(f"{source}: unsupported hidden_activation {activation!r}; supported: {GEMMA_ACTIVATION!r}")
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError(f"{source}: use_bidirectional_attention=True (an embedding model) is not supported")
    num_layers = int(require(cfg, "num_hidden_layers", source))
    types = cfg.get("layer_types")
    if not types:
        default = 6 if model_type == "gemma3_text" else 2
        period = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or default
        types = pattern_layer_types(num_layers, int(period))
    types = tuple(types)
    check_layer_types(types, num_layers, source)
    window = cfg.get("sliding_window") if SLIDING in types else None
    if SLIDING in types and not window:
        raise ConfigError(f"{source}: layer_types has sliding layers but sliding_window={window!r}")
    softcaps = {k: cfg.get(k) for k in ("attn_logit_softcapping", "final_logit_softcapping")}
    if model_type == "gemma3_text":
        softcaps["attn_logit_softcapping"] = None  # Gemma 3's attention never applies it
    return dict(layer_types=types, sliding_window=int(window) if window else None,
                query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or 256),
                attn_logit_softcap=_positive_or_none(softcaps["attn_logit_softcapping"], "attn_logit_softcapping", source),
                final_logit_softcap=_positive_or_none(softcaps["final_logit_softcapping"], "final_logit_softcapping", source),
                qk_norm=model_type == "gemma3_text")


def gemma_from_gguf(meta: Mapping[str, Any], arch: str, num_layers: int, hidden: int, heads: int,
                    head_dim: int) -> dict[str, Any]:
    """The Gemma fields of GGUF metadata, with llama.cpp's fixed values where the file is silent."""
    window = meta.get(f"{arch}.attention.sliding_window")
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", _GGUF_PATTERN[arch])
    if isinstance(pattern, (list, tuple)):  # per layer: True where the layer slides
        types = tuple(SLIDING if flag else FULL for flag in pattern)
    else:
        types = pattern_layer_types(num_layers, int(pattern))
    check_layer_types(types, num_layers, "GGUF metadata")
    local = meta.get(f"{arch}.rope.freq_base_swa", _GGUF_LOCAL_THETA.get(arch))
    scalar = hidden / heads if num_layers == _GGUF_27B_LAYERS[arch] else head_dim
    caps = ({"attn": meta.get("gemma2.attn_logit_softcapping", 50.0),
             "final": meta.get("gemma2.final_logit_softcapping", 30.0)} if arch == "gemma2"
            else {"attn": None, "final": meta.get(f"{arch}.final_logit_softcapping")})
    return dict(model_type="gemma3_text" if arch == "gemma3" else arch, layer_types=types,
                sliding_window=int(window) if window and SLIDING in types else None,
                rope_local_theta=None if local is None else float(local),
                query_pre_attn_scalar=float(scalar), qk_norm=arch == "gemma3",
                attn_logit_softcap=_positive_or_none(caps["attn"], "attn_logit_softcapping", "GGUF metadata"),
                final_logit_softcap=_positive_or_none(caps["final"], "final_logit_softcapping", "GGUF metadata"))


def gemma_to_hf(config) -> dict[str, Any]:
    """The Gemma keys of a config.json for `config` (a gemma-family ModelConfig)."""
    cfg = {"layer_types": list(config.layer_types), "query_pre_attn_scalar": config.query_pre_attn_scalar,
           "attn_logit_softcapping": config.attn_logit_softcap, "final_logit_softcapping": config.final_logit_softcap,
           "hidden_activation": GEMMA_ACTIVATION, "sliding_window": config.sliding_window}
    if config.model_type == "gemma3_text":
        full = {"rope_theta": config.rope_theta, "rope_type": "default"}
        if config.rope_scaling is not None:
            full.update(rope_type=config.rope_scaling.rope_type, factor=config.rope_scaling.factor)
        local = {"rope_theta": config.rope_local_theta or config.rope_theta, "rope_type": "default"}
        cfg["rope_parameters"] = {FULL: full, SLIDING: local}
    return cfg


def _positive_or_none(value, name: str, source: str) -> float | None:
    if value is None:
        return None
    if not float(value) > 0:
        raise ConfigError(f"{source}: {name}={value!r} must be a positive number or null")
    return float(value)
