"""The Gemma family's model code: Gemma 2 and Gemma 3 (text), one decoder, config-driven.

Data flow of `forward`: token ids -> embedding times sqrt(E) (the factor rounded to the model
dtype first) -> for each layer [RMSNorm -> one q|k|v projection -> RMSNorm of each q and k head
(Gemma 3's QK-norm) -> RoPE of the layer's type -> ragged paged attention (scores scaled by
query_pre_attn_scalar ** -0.5, tanh soft-capped in Gemma 2, a sliding window on the
"sliding_attention" layers) -> output projection -> RMSNorm -> residual -> RMSNorm -> one
gate|up projection -> GELU(tanh)-gated product -> down projection -> RMSNorm -> residual] ->
final RMSNorm -> hidden states. `compute_logits` applies the LM head (tied to the embedding in
every released Gemma) and the final tanh soft cap (Gemma 2).

Every RMSNorm here scales by (1 + w), w as the checkpoint stores it, in float32 before casting
back (`rms_norm`); GGUF files store 1 + w, which names.py turns back into w.

Local and global layers: layers are unrolled in Python and each has its own cache array (as in
llama/model.py), so a layer's window and rope table are fixed when the step is traced. Both rope tables
(local base rope_local_theta, unscaled; global rope_theta with rope_scaling) are computed once
per step and each layer's attention is traced with its own window: one compiled step serves
every layer pattern, with nothing recompiled per step.
"""

from __future__ import annotations

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from jaxinfer.config import ModelConfig
from jaxinfer.config.sources import is_sliding_layer
from jaxinfer.models import layers as L
from jaxinfer.models.llama import model as llama
from jaxinfer.quant import einsum
from jaxinfer.quant.lora_vocab import vocab_rows


@flax.struct.dataclass
class GemmaLayer:
    attn_norm: jax.Array  # [E]: input_layernorm
    w_qkv: jax.Array  # [E, K, G+2, D] as in LlamaLayer
    wo: jax.Array  # [H, D, E]
    post_attn_norm: jax.Array  # [E]
    mlp_norm: jax.Array  # [E]: pre_feedforward_layernorm
    w_gate_up: jax.Array  # [E, 2, F]
    w_down: jax.Array  # [F, E]
    post_mlp_norm: jax.Array  # [E]
    q_norm: jax.Array | None = None  # [D]: Gemma 3's QK-norm, shared by every query head
    k_norm: jax.Array | None = None  # [D]: ... and by every KV head


@flax.struct.dataclass
class GemmaParams:
    embed: jax.Array  # [V, E]
    layers: tuple[GemmaLayer, ...]
    final_norm: jax.Array  # [E]
    lm_head: jax.Array | None = None  # [E, V]; None when tied to `embed`
    # The LM head's tanh soft cap (config.final_logit_softcap): static, since compute_logits sees
    # only the parameters.
    final_logit_softcap: float | None = flax.struct.field(pytree_node=False, default=None)


_POST_NORMS = ("post_attn_norm", "post_mlp_norm")
PARAM_AXES = {**llama.PARAM_AXES, **dict.fromkeys(_POST_NORMS, ("embed",))}
LINEAR_INPUTS = llama.LINEAR_INPUTS
top_fields = llama.top_fields


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {**llama.param_shapes(config), **dict.fromkeys(_POST_NORMS, (config.hidden_size,))}


def layer_fields(config: ModelConfig) -> list[str]:
    """One layer's tensors in a checkpoint, by our field names (before `assemble` fuses them)."""
    fields = [
        "attn_norm",
        "wq",
        "wk",
        "wv",
        "wo",
        "post_attn_norm",
        "mlp_norm",
        "w_gate",
        "w_up",
        "w_down",
        "post_mlp_norm",
    ]
    return fields + (["q_norm", "k_norm"] if config.qk_norm else [])


def assemble(config: ModelConfig, top: L.Fields, per_layer: list[L.Fields]) -> GemmaParams:
    """The parameter tree from arrays keyed by field name, q|k|v and gate|up fused (each layer's
    unfused arrays popped as it is built)."""
    return GemmaParams(
        embed=top["embed"],
        final_norm=top["final_norm"],
        lm_head=top.get("lm_head"),
        layers=tuple(GemmaLayer(**llama.fuse_gate_up(llama.fuse_qkv(fields))) for fields in per_layer),
        final_logit_softcap=config.final_logit_softcap,
    )


def init_params(
    config: ModelConfig, key: jax.Array, dtype: DTypeLike = jnp.float32, scale: float = 0.02
) -> GemmaParams:
    """Random parameters (for tests and benchmarks): normal(0, scale); norm weights 0 (scale 1)."""
    top, per_layer = llama.random_fields(
        param_shapes(config), top_fields(config), layer_fields(config), config.num_layers, key, dtype, scale, 0.0
    )
    return assemble(config, top, per_layer)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., E] normalised and scaled by (1 + weight), both in float32, then cast back."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def _attention(
    x: jax.Array,
    p: GemmaLayer,
    kv_cache: L.KVCache,
    cos: jax.Array,
    sin: jax.Array,
    meta: L.AttentionMetadata[jax.Array],
    config: ModelConfig,
    attn_impl: str,
    sliding: bool,
) -> tuple[jax.Array, L.KVCache]:
    """x [T, E] -> x + post_norm(attention(norm(x))), and the layer's updated cache."""
    eps = config.rms_norm_eps
    qkv = L.project_qkv(rms_norm(x, p.attn_norm, eps), p.w_qkv)  # [T, K, G+2, D]
    t, kv_heads, group, d = qkv.shape[0], qkv.shape[1], qkv.shape[2] - 2, qkv.shape[3]
    q = qkv[:, :, :group].reshape(t, kv_heads * group, d)  # [T, H, D]
    k, v = qkv[:, :, group], qkv[:, :, group + 1]  # [T, K, D] each
    if p.q_norm is not None and p.k_norm is not None:
        q, k = rms_norm(q, p.q_norm, eps), rms_norm(k, p.k_norm, eps)
    q, k = L.apply_rope(q, cos, sin), L.apply_rope(k, cos, sin)
    attn, kv_cache = L.paged_attention(q, k, v, kv_cache, meta, config, attn_impl, sliding)
    out = einsum("thd,hde->te", attn, p.wo)  # [T, E]
    return x + rms_norm(out, p.post_attn_norm, eps), kv_cache


def _mlp(x: jax.Array, p: GemmaLayer, eps: float) -> jax.Array:
    """x [T, E] -> x + post_norm(down(gelu_tanh(gate(h)) * up(h))), h = norm(x)."""
    gate_up = einsum("te,ecf->tcf", rms_norm(x, p.mlp_norm, eps), p.w_gate_up)  # [T, 2, F]
    hidden = jax.nn.gelu(gate_up[:, 0], approximate=True) * gate_up[:, 1]  # [T, F]
    return x + rms_norm(einsum("tf,fe->te", hidden, p.w_down), p.post_mlp_norm, eps)


def _layer(
    x: jax.Array,
    p: GemmaLayer,
    kv_cache: L.KVCache,
    cos: jax.Array,
    sin: jax.Array,
    meta: L.AttentionMetadata[jax.Array],
    config: ModelConfig,
    attn_impl: str,
    sliding: bool,
) -> tuple[jax.Array, L.KVCache]:
    x, kv_cache = _attention(x, p, kv_cache, cos, sin, meta, config, attn_impl, sliding)
    return _mlp(x, p, config.rms_norm_eps), kv_cache


def _local_config(config: ModelConfig) -> ModelConfig:
    """The config whose rope the sliding layers use: their own base, no scaling."""
    if config.rope_local_theta is None:
        return config
    return dataclasses.replace(config, rope_theta=config.rope_local_theta, rope_scaling=None, rope_freq_factors=None)


def forward(
    params: GemmaParams,
    config: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    kv_caches: tuple[L.KVCache, ...],
    meta: L.AttentionMetadata[jax.Array],
    *,
    attn_impl: str = "auto",
) -> tuple[jax.Array, tuple[L.KVCache, ...]]:
    """tokens, positions i32[T]; kv_caches: one [P, page, 2K, D] array per layer, or per slot of
    the model's KV layout (layers.layer_kv).

    Returns (hidden [T, E] after the final norm, new kv_caches tuple)."""
    embed = params.embed  # the normalizer also scales an embedding adapter's share, as PEFT's Gemma embedding does
    x = vocab_rows(embed, tokens) * jnp.asarray(math.sqrt(config.hidden_size), jnp.float32).astype(embed.dtype)
    rope_global = L.rope_cos_sin(positions, L.rope_inv_freq(config))
    local = _local_config(config)
    rope_local = rope_global if local is config else L.rope_cos_sin(positions, L.rope_inv_freq(local))
    caches = list(kv_caches)
    layer_call = L.traced_once(_layer)
    for i, layer in enumerate(params.layers):
        sliding = is_sliding_layer(config.layer_types, i)  # the layer's window: config.layer_window
        cos, sin = rope_local if config.layer_types and sliding else rope_global
        c, layer_meta = L.layer_kv(config, caches, meta, i)
        x, caches[c] = layer_call(x, layer, caches[c], cos, sin, layer_meta, config, attn_impl, sliding)
    return rms_norm(x, params.final_norm, config.rms_norm_eps), tuple(caches)


def compute_logits(params: GemmaParams, hidden: jax.Array) -> jax.Array:
    """hidden [N, E] -> logits f32[N, V], soft-capped to (-cap, cap) where the model has a cap."""
    logits = llama.compute_logits(params, hidden)
    cap = params.final_logit_softcap
    return logits if cap is None else cap * jnp.tanh(logits / cap)
