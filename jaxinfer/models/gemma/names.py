"""Checkpoint name maps of the Gemma family: HF safetensors names and GGUF names -> our fields.

Projections, embeddings and the QK-norm are named as in Llama (llama/names.py); Gemma adds a norm
after attention and one on each side of the MLP:

  ours            HF (model.layers.{i}.)                  GGUF (blk.{i}.)
  attn_norm       input_layernorm.weight                  attn_norm.weight
  post_attn_norm  post_attention_layernorm.weight         post_attention_norm.weight
  mlp_norm        pre_feedforward_layernorm.weight        ffn_norm.weight
  post_mlp_norm   post_feedforward_layernorm.weight       post_ffw_norm.weight

HF stores every norm weight as w (the layer scales by 1 + w); llama.cpp's converter stores 1 + w,
so GGUF norms are read back as stored - 1. GGUF q/k projections of Gemma are not permuted.
"""

from __future__ import annotations

from jaxinfer.config import ModelConfig
from jaxinfer.models.gemma.model import layer_fields, param_shapes, top_fields
from jaxinfer.models.llama import names as llama_names
from jaxinfer.models.specs import TensorSpec

IGNORED = llama_names.IGNORED
_HF_LAYER = {
    "attn_norm": "input_layernorm.weight",
    "post_attn_norm": "post_attention_layernorm.weight",
    "mlp_norm": "pre_feedforward_layernorm.weight",
    "post_mlp_norm": "post_feedforward_layernorm.weight",
}
_GGUF_LAYER = {
    "attn_norm": "attn_norm.weight",
    "post_attn_norm": "post_attention_norm.weight",
    "mlp_norm": "ffn_norm.weight",
    "post_mlp_norm": "post_ffw_norm.weight",
}


def _norm_spec(name: str, field: str, layer: int | None, size: int, fmt: str) -> TensorSpec:
    if fmt == "gguf":
        return TensorSpec(name, field, layer, (size,), lambda w: w - 1)
    return TensorSpec(name, field, layer, (size,), lambda w: w)


def checkpoint_specs(config: ModelConfig, fmt: str) -> list[TensorSpec]:
    """Every tensor the checkpoint must hold, in load order. fmt: "hf", "gguf", or "ours" (our own
    fields in our layout, named "embed", "layers.3.post_mlp_norm", ...: what `jaxinfer convert` saves)."""
    if fmt == "ours":
        return llama_names.ours_specs(param_shapes(config), top_fields(config), layer_fields(config), config.num_layers)
    if fmt not in ("hf", "gguf"):
        raise ValueError(f"unknown checkpoint format {fmt!r}")
    # Llama's map names the projections, embeddings, final and QK norms (Gemma does not permute
    # GGUF q/k: llama_names only does that for the "llama" architecture).
    shared = {(s.layer, s.field): s for s in llama_names.checkpoint_specs(config, fmt)}
    e, d = config.hidden_size, config.head_dim
    norms = _HF_LAYER if fmt == "hf" else _GGUF_LAYER
    specs = []
    for field in top_fields(config):
        spec = shared[(None, field)]
        specs.append(_norm_spec(spec.name, field, None, e, fmt) if field == "final_norm" else spec)
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}." if fmt == "hf" else f"blk.{i}."
        for field in layer_fields(config):
            if field in norms:
                specs.append(_norm_spec(prefix + norms[field], field, i, e, fmt))
            elif field in ("q_norm", "k_norm"):
                specs.append(_norm_spec(shared[(i, field)].name, field, i, d, fmt))
            else:
                specs.append(shared[(i, field)])
    return specs
