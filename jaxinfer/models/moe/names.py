"""Checkpoint name maps of the MoE family (Mixtral, Qwen3-MoE): HF safetensors names -> our fields.

Attention, norms, embeddings and Qwen3-MoE's dense MLP layers are named as in Llama
(llama/names.py); a sparse layer adds its router and one tensor per expert and per projection
(Mixtral: block_sparse_moe.experts.{j}.w1 | w3 | w2 for gate | up | down; Qwen3-MoE:
mlp.experts.{j}.gate_proj | up_proj | down_proj), each [out, in] as HF stores projections.
A GGUF (llama.cpp's layout: Mixtral as architecture "llama", Qwen3-MoE as "qwen3moe") holds each
sparse layer's experts stacked: blk.N.ffn_gate_exps | ffn_up_exps [X, F, E] and ffn_down_exps
[X, E, F] (each expert [out, in]), read whole into the fields experts_gate | experts_up |
experts_down, and the router as blk.N.ffn_gate_inp [X, E].
"""

from __future__ import annotations

from jaxinfer.config import ModelConfig
from jaxinfer.models.llama import names as llama_names
from jaxinfer.models.moe.model import field_shape, layer_fields, top_fields
from jaxinfer.models.specs import TensorSpec

IGNORED = llama_names.IGNORED
# model_type -> (module prefix of a sparse layer's MLP, names of gate, up, down in one expert)
_HF_SPARSE = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}
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


def _gguf_sparse_specs(config: ModelConfig, i: int) -> list[TensorSpec]:
    experts_last = lambda w: w.transpose(0, 2, 1)  # noqa: E731  [X, out, in] -> [X, in, out]
    specs = [_transposed(f"blk.{i}.ffn_gate_inp.weight", "router", i, field_shape(config, "router"))]
    for field, name in (
        ("experts_gate", "ffn_gate_exps"),
        ("experts_up", "ffn_up_exps"),
        ("experts_down", "ffn_down_exps"),
    ):
        x, a, b = field_shape(config, field)
        specs.append(TensorSpec(f"blk.{i}.{name}.weight", field, i, (x, b, a), experts_last))
    return specs


def checkpoint_specs(config: ModelConfig, fmt: str) -> list[TensorSpec]:
    """Every tensor the checkpoint must hold, in load order. fmt: "hf", "gguf" or "ours" (our own
    fields in our layout, named "embed", "layers.3.expert_up.5", ...: what `jaxinfer convert` saves)."""
    if fmt == "ours":
        keep = lambda w: w  # noqa: E731
        return [TensorSpec(f, f, None, field_shape(config, f), keep) for f in top_fields(config)] + [
            TensorSpec(f"layers.{i}.{f}", f, i, field_shape(config, f), keep)
            for i in range(config.num_layers)
            for f in layer_fields(config, i)
        ]
    if fmt not in ("hf", "gguf"):
        raise ValueError(f"unknown checkpoint format {fmt!r}")
    specs = []
    for spec in llama_names.checkpoint_specs(config, fmt):  # attention, norms, dense MLPs
        if spec.layer is not None and config.is_moe_layer(spec.layer) and spec.field in ("w_gate", "w_up", "w_down"):
            continue
        specs.append(spec)
    for i in range(config.num_layers):
        if config.is_moe_layer(i):
            specs += _sparse_specs(config, i) if fmt == "hf" else _gguf_sparse_specs(config, i)
    return specs
