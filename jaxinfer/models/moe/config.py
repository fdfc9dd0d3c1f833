"""The MoE family's own config fields: Llama's (llama/config.py: its attention) and the experts'.

HF     num_local_experts (Mixtral) | num_experts, num_experts_per_tok, moe_intermediate_size,
       norm_topk_prob (Mixtral renormalises always), decoder_sparse_step, mlp_only_layers
GGUF   {arch}.expert_count, expert_used_count, expert_feed_forward_length (Mixtral's experts
       have the feed_forward_length), expert_weights_norm; a layer without a router tensor
       (blk.N.ffn_gate_inp) keeps a dense MLP, since a GGUF lists no dense layers
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

from jaxinfer.config.errors import ConfigError, require
from jaxinfer.models.llama import config as llama

if TYPE_CHECKING:
    from jaxinfer.config import ModelConfig  # the config module reads these at its import

_EXPORTED = ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step")


def read_hf(cfg: Mapping[str, Any], shared: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Mixtral routes every layer and renormalises its top-k always; Qwen3-MoE says which layers
    route (mlp_only_layers, decoder_sparse_step) and whether to renormalise."""
    attention = llama.read_hf(cfg, shared, source)
    experts, top_k = cfg.get("num_experts") or cfg.get("num_local_experts"), require(cfg, "num_experts_per_tok", source)
    if not experts or not 1 <= int(top_k) <= int(experts):
        raise ConfigError(f"{source}: num_experts_per_tok={top_k} must be in 1..num_experts={experts}")
    return dict(
        attention,
        num_experts=int(experts),
        num_experts_per_tok=int(top_k),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", shared["model_type"] == "mixtral")),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
    )


def read_gguf(
    meta: Mapping[str, Any], arch: str, shared: Mapping[str, Any], tensor_names: Collection[str] | None, source: str
) -> dict[str, Any]:
    """The top k renormalised unless {arch}.expert_weights_norm is false (llama.cpp renormalises
    both families)."""
    attention = llama.read_gguf(meta, arch, shared, tensor_names, source)
    experts, top_k = (
        int(require(meta, f"{arch}.expert_count", source)),
        int(require(meta, f"{arch}.expert_used_count", source)),
    )
    if not 1 <= top_k <= experts:
        raise ConfigError(f"{source}: {arch}.expert_used_count={top_k} must be in 1..expert_count={experts}")
    width = meta.get(f"{arch}.expert_feed_forward_length") or require(meta, f"{arch}.feed_forward_length", source)
    dense = (
        ()
        if tensor_names is None
        else tuple(i for i in range(shared["num_layers"]) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names)
    )
    return dict(
        attention,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(width),
        norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", True)),
        mlp_only_layers=dense,
    )


def to_hf(config: ModelConfig) -> dict[str, Any]:
    if not config.num_experts:
        return llama.to_hf(config)
    return dict(
        llama.to_hf(config),
        num_local_experts=config.num_experts,
        mlp_only_layers=list(config.mlp_only_layers),
        **{k: getattr(config, k) for k in _EXPORTED},
    )


def serves_gguf(meta: Mapping[str, Any], arch: str) -> bool:
    """llama.cpp's architecture "llama" is Mixtral when it has experts (and Llama otherwise)."""
    return arch != "llama" or bool(meta.get("llama.expert_count"))
