"""Checkpoint name maps of the Llama family: HF safetensors names and GGUF names -> our fields.

Each `TensorSpec` names one checkpoint tensor, its shape in the checkpoint, and how to turn it
into our layout (HF stores projections as [out, in]; we keep [in, heads, head_dim] so einsums
read naturally). GGUF tensors, once dequantized, have HF's shapes; llama.cpp additionally
permutes the rows of q/k projections of the "llama" architecture into interleaved rotary pairs,
which `_unpermute_rope` undoes.
"""

from __future__ import annotations

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.models.llama.model import layer_fields, param_shapes, top_fields
from jaxinfer.models.specs import TensorSpec

_HF_TOP = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}
_HF_LAYER = {
    "attn_norm": "input_layernorm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
    "bo": "self_attn.o_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}
_GGUF_TOP = {"embed": "token_embd.weight", "final_norm": "output_norm.weight", "lm_head": "output.weight"}
_GGUF_LAYER = {
    "attn_norm": "attn_norm.weight",
    "mlp_norm": "ffn_norm.weight",
    "wq": "attn_q.weight",
    "wk": "attn_k.weight",
    "wv": "attn_v.weight",
    "wo": "attn_output.weight",
    "bq": "attn_q.bias",
    "bk": "attn_k.bias",
    "bv": "attn_v.bias",
    "bo": "attn_output.bias",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    "w_gate": "ffn_gate.weight",
    "w_up": "ffn_up.weight",
    "w_down": "ffn_down.weight",
}
# Tensors a checkpoint may carry that the model recomputes (inv_freq) or reads into its config
# (GGUF rope_freqs, the llama3 rope scaling factors).
IGNORED = ("rotary_emb.inv_freq", "rope_freqs.weight")


def _hf_layout(config: ModelConfig) -> dict:
    """field -> (checkpoint shape, transform to our shape)."""
    e, h, k, d, f, v = (
        config.hidden_size,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.intermediate_size,
        config.vocab_size,
    )
    same = lambda w: w  # noqa: E731
    t = lambda w: w.T  # noqa: E731
    return {
        "embed": ((v, e), same),
        "final_norm": ((e,), same),
        "lm_head": ((v, e), t),
        "attn_norm": ((e,), same),
        "mlp_norm": ((e,), same),
        "wq": ((h * d, e), lambda w: w.T.reshape(e, h, d)),
        "wk": ((k * d, e), lambda w: w.T.reshape(e, k, d)),
        "wv": ((k * d, e), lambda w: w.T.reshape(e, k, d)),
        "wo": ((e, h * d), lambda w: w.T.reshape(h, d, e)),
        "bq": ((h * d,), lambda b: b.reshape(h, d)),
        "bk": ((k * d,), lambda b: b.reshape(k, d)),
        "bv": ((k * d,), lambda b: b.reshape(k, d)),
        "bo": ((e,), same),
        "q_norm": ((d,), same),
        "k_norm": ((d,), same),
        "w_gate": ((f, e), t),
        "w_up": ((f, e), t),
        "w_down": ((e, f), t),
    }


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """[n_heads * D, ...] rows from llama.cpp's interleaved rotary order back to half-split."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def ours_specs(
    shapes: dict[str, tuple[int, ...]], top_names: list[str], layer_names: list[str], num_layers: int
) -> list[TensorSpec]:
    """Our own checkpoint's tensors ("embed", "layers.3.wq", ...), in our layout, in load order."""
    keep = lambda w: w  # noqa: E731
    return [TensorSpec(f, f, None, shapes[f], keep) for f in top_names] + [
        TensorSpec(f"layers.{i}.{f}", f, i, shapes[f], keep) for i in range(num_layers) for f in layer_names
    ]


def checkpoint_specs(config: ModelConfig, fmt: str) -> list[TensorSpec]:
    """Every tensor the checkpoint must hold, in load order. fmt: "hf", "gguf", or "ours" (our
    own fields in our layout, named "embed", "layers.3.wq", ...: what `jaxinfer convert` saves)."""
    if fmt == "ours":
        return ours_specs(param_shapes(config), top_fields(config), layer_fields(config), config.num_layers)
    if fmt not in ("hf", "gguf"):
        raise ValueError(f"unknown checkpoint format {fmt!r}")
    top_names, layer_names = (_HF_TOP, _HF_LAYER) if fmt == "hf" else (_GGUF_TOP, _GGUF_LAYER)
    layout = _hf_layout(config)
    if fmt == "gguf" and config.model_type in ("llama", "mixtral"):  # llama.cpp's "llama" architecture
        for field, heads in (
            ("wq", config.num_heads),
            ("wk", config.num_kv_heads),
            ("bq", config.num_heads),
            ("bk", config.num_kv_heads),
        ):
            shape, to_ours = layout[field]
            layout[field] = (shape, lambda w, f=to_ours, n=heads: f(_unpermute_rope(w, n)))
    specs = [TensorSpec(top_names[f], f, None, *layout[f]) for f in top_fields(config)]
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}." if fmt == "hf" else f"blk.{i}."
        specs += [TensorSpec(prefix + layer_names[f], f, i, *layout[f]) for f in layer_fields(config)]
    return specs
