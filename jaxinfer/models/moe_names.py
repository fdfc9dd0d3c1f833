"""Checkpoint name maps of the MoE family (Mixtral, Qwen3-MoE): HF safetensors names -> our fields.

Attention, norms, embeddings and Qwen3-MoE's dense MLP layers are named as in Llama
(llama_names); a sparse layer adds its router and one tensor per expert and per projection
(Mixtral: block_sparse_moe.experts.{j}.w1 | w3 | w2 for gate | up | down; Qwen3-MoE:
mlp.experts.{j}.gate_proj | up_proj | down_proj), each [out, in] as HF stores projections.
GGUF MoE checkpoints (stacked ffn_*_exps tensors) are not read yet.
"""
from __future__ import annotations

from jaxinfer.config import ModelConfig
from jaxinfer.models import llama_names
from jaxinfer.models.moe import field_shape, layer_fields, top_fields
from jaxinfer.models.specs import TensorSpec

IGNORED = llama_names.IGNORED
# model_type -> (module prefix of a sparse layer's MLP, names of gate, up, down in one expert)
_HF_SPARSE = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
              "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"))}
_KINDS = ("expert_gate", "expert_up", "expert_down")


def _transposed(name: str, field: str, layer: int, ours: tuple[int, ...]) -> TensorSpec:
    return TensorSpec(name, field, layer, ours[::-1], lambda w: w.T)


def _sparse_specs(config: ModelConfig, i: int) -> list[TensorSpec]:
    module, names = _HF_SPARSE[config.model_type]
    prefix = f"model.layers.{i}.{module}."
    specs = [_transposed(prefix + "gate.weight", "router", i, field_shape(config, "router"))]
    for j in range(config.num_experts):
        for kind, name in zip(_KINDS, names):
            field = f"{kind}.{j}"
            specs.append(_transposed(f"{prefix}experts.{j}.{name}.weight", field, i, field_shape(config, field)))
    return specs


def checkpoint_specs(config: ModelConfig, fmt: str) -> list[TensorSpec]:
    """Every tensor the checkpoint must hold, in load order. fmt: "hf" or "ours" (our own fields
    in our layout, named "embed", "layers.3.expert_up.5", ...: what `jaxinfer convert` saves)."""
    if fmt == "ours":
        keep = lambda w: w  # noqa: E731
        return ([TensorSpec(f, f, None, field_shape(config, f), keep) for f in top_fields(config)]
                + [TensorSpec(f"layers.{i}.{f}", f, i, field_shape(config, f), keep)
                   for i in range(config.num_layers) for f in layer_fields(config, i)])
    if fmt != "hf":
        raise ValueError(f"checkpoint format {fmt!r} is not supported for {config.model_type} "
                         "(mixtures of experts load from HF safetensors or our orbax checkpoints)")
    specs = []
    for spec in llama_names.checkpoint_specs(config, "hf"):  # attention, norms, dense MLPs
        if spec.layer is not None and config.is_moe_layer(spec.layer) and spec.field in ("w_gate", "w_up", "w_down"):
            continue
        specs.append(spec)
    for i in range(config.num_layers):
        if config.is_moe_layer(i):
            specs += _sparse_specs(config, i)
    return specs
