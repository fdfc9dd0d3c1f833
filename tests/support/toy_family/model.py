"""ToyLlama's model code: Llama's parameters, a forward pass with scaled residual branches, and its
own checkpoint names.

    ours          checkpoint (stored [in, out]: no transposes)
    embed         tok_embeddings               [V, E]
    final_norm    norm                         [E]
    lm_head       output                       [E, V]
    attn_norm     blocks.{i}.attn_norm         [E]
    wq | wk | wv  blocks.{i}.attn.q | k | v    [E, H*D] | [E, K*D] | [E, K*D]
    wo            blocks.{i}.attn.out          [H*D, E]
    mlp_norm      blocks.{i}.mlp_norm          [E]
    w_gate | w_up blocks.{i}.mlp.gate | up     [E, F]
    w_down        blocks.{i}.mlp.down          [F, E]
"""

from __future__ import annotations

import math

from jaxinfer.models import layers as L
from jaxinfer.models import linear_layout as LL
from jaxinfer.models.llama import model as llama
from jaxinfer.models.llama import names as llama_names
from jaxinfer.models.registry import ModelFamily
from jaxinfer.models.specs import TensorSpec
from jaxinfer.quant import einsum
from toy_family import RESIDUAL_SCALE

TOP = {"embed": "tok_embeddings", "final_norm": "norm", "lm_head": "output"}
LAYER = {
    "attn_norm": "attn_norm",
    "wq": "attn.q",
    "wk": "attn.k",
    "wv": "attn.v",
    "wo": "attn.out",
    "mlp_norm": "mlp_norm",
    "w_gate": "mlp.gate",
    "w_up": "mlp.up",
    "w_down": "mlp.down",
}


def checkpoint_specs(config, fmt: str) -> list[TensorSpec]:
    shapes = llama.param_shapes(config)
    if fmt == "ours":
        return llama_names.ours_specs(shapes, llama.top_fields(config), llama.layer_fields(config), config.num_layers)
    if fmt != "hf":
        raise ValueError(f"toyllama checkpoints come as safetensors, not {fmt!r}")

    def spec(name: str, field: str, layer: int | None) -> TensorSpec:
        ours = shapes[field]  # [in..., out...]; stored as one [in, out] matrix (a norm as it is)
        inputs = len(llama.LINEAR_INPUTS.get(field, (0,)))
        stored = ours if len(ours) == 1 else (math.prod(ours[:inputs]), math.prod(ours[inputs:]))
        return TensorSpec(name, field, layer, stored, lambda w, shape=ours: w.reshape(shape))

    specs = [spec(TOP[f], f, None) for f in llama.top_fields(config)]
    return specs + [
        spec(f"blocks.{i}.{LAYER[f]}", f, i) for i in range(config.num_layers) for f in llama.layer_fields(config)
    ]


def _layer(x, p, kv_cache, cos, sin, meta, config, attn_impl: str):
    """Llama's layer with both residual branches scaled by RESIDUAL_SCALE."""
    qkv = L.project_qkv(L.rms_norm(x, p.attn_norm, config.rms_norm_eps), p.w_qkv)  # [T, K, G+2, D]
    t, kv_heads, group, d = qkv.shape[0], qkv.shape[1], qkv.shape[2] - 2, qkv.shape[3]
    q = qkv[:, :, :group].reshape(t, kv_heads * group, d)
    k, v = qkv[:, :, group], qkv[:, :, group + 1]
    q, k = L.apply_rope(q, cos, sin), L.apply_rope(k, cos, sin)
    attn, kv_cache = L.paged_attention(q, k, v, kv_cache, meta, config, attn_impl)
    x = x + RESIDUAL_SCALE * einsum("thd,hde->te", attn, p.wo)
    h = L.rms_norm(x, p.mlp_norm, config.rms_norm_eps)
    return x + RESIDUAL_SCALE * L.gated_mlp(h, p.w_gate_up, p.w_down), kv_cache


def forward(params, config, tokens, positions, kv_caches, meta, *, attn_impl: str = "auto"):
    return L.decoder_stack(_layer, params, config, tokens, positions, kv_caches, meta, attn_impl)


def family() -> ModelFamily:
    return ModelFamily(
        name="toyllama",
        forward=forward,
        compute_logits=llama.compute_logits,
        init_params=llama.init_params,
        assemble=llama.assemble,
        checkpoint_specs=checkpoint_specs,
        ignored_tensors=(),
        param_axes=llama.PARAM_AXES,
        linear_inputs=llama.LINEAR_INPUTS,
        compute_layout=LL.linear_layout,
        traits=("residual branches scaled by 0.5",),
    )
