"""The Llama family's model code: Llama 2/3/3.x, Mistral, Qwen2/2.5, Qwen3, SmolLM2 (one decoder).

Data flow of `forward`: token ids -> embedding -> for each layer [RMSNorm -> one q|k|v projection
(+ bias for Qwen2) -> RMSNorm of each q and k head over head_dim (Qwen3's QK-norm) -> RoPE ->
ragged paged attention (writes this step's K/V into the layer's pages, then attends) -> output
projection -> residual -> RMSNorm -> one gate|up projection -> SiLU-gated product -> down
projection -> residual] -> final RMSNorm -> hidden states. `compute_logits` applies the LM head
(tied or not) to the rows the caller selects, so a step computes logits only for the tokens it
samples.

Layers are unrolled in Python and each layer's KV cache is its own array, so every layer's
cache is updated in place when the caller donates the tuple.

Fused projections: a checkpoint's q, k, v (and gate, up) tensors are loaded, and placed, one by
one under their own names; `assemble` then fuses them once into `w_qkv` [E, K, G+2, D] (for each
KV head its G = H/K query heads, then its K and V) and `w_gate_up` [E, 2, F], so a layer runs one
matmul for each instead of three and two (and XLA never concatenates weights inside the step).
Splitting the KV-head axis over `tensor` gives each shard whole groups with their own q|k|v
columns; K here is the KV heads the cache carries (see sharding/rules.py on replicated heads).
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from jaxinfer.config import ModelConfig
from jaxinfer.models import layers as L
from jaxinfer.models.ticks import decoder_tick
from jaxinfer.quant import einsum, fuse
from jaxinfer.quant.lora_vocab import head_logits, unwrapped


@flax.struct.dataclass
class LlamaLayer:
    attn_norm: jax.Array  # [E]
    w_qkv: jax.Array  # [E, K, G+2, D]: per KV head, its G query heads, then K, then V
    wo: jax.Array  # [H, D, E]
    mlp_norm: jax.Array  # [E]
    w_gate_up: jax.Array  # [E, 2, F]: gate, then up
    w_down: jax.Array  # [F, E]
    b_qkv: jax.Array | None = None  # [K, G+2, D]
    bo: jax.Array | None = None  # [E]
    q_norm: jax.Array | None = None  # [D]: QK-norm weights, shared by every query head
    k_norm: jax.Array | None = None  # [D]: ... and by every KV head


@flax.struct.dataclass
class LlamaParams:
    embed: jax.Array  # [V, E]
    layers: tuple[LlamaLayer, ...]
    final_norm: jax.Array  # [E]
    lm_head: jax.Array | None = None  # [E, V]; None when tied to `embed`


# Logical axis names of every parameter (for sharding rules); "layers" params repeat per layer.
# The checkpoint's separate q/k/v and gate/up tensors are placed under their own names before
# `assemble` fuses them, so both forms are here.
PARAM_AXES = {
    "w_qkv": ("embed", "kv_heads", "qkv", "head_dim"),
    "b_qkv": ("kv_heads", "qkv", "head_dim"),
    "w_gate_up": ("embed", "gate_up", "mlp"),
    "embed": ("vocab", "embed"),
    "final_norm": ("embed",),
    "lm_head": ("embed", "vocab"),
    "attn_norm": ("embed",),
    "wq": ("embed", "heads", "head_dim"),
    "wk": ("embed", "kv_heads", "head_dim"),
    "wv": ("embed", "kv_heads", "head_dim"),
    "wo": ("heads", "head_dim", "embed"),
    "mlp_norm": ("embed",),
    "w_gate": ("embed", "mlp"),
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
    "bq": ("heads", "head_dim"),
    "bk": ("kv_heads", "head_dim"),
    "bv": ("kv_heads", "head_dim"),
    "bo": ("embed",),
    "q_norm": ("head_dim",),
    "k_norm": ("head_dim",),
}


# The input (contracted) axes of each linear weight: weight-only quantization (jaxinfer.quant)
# keeps one scale per output channel over them, or groups along the last of them.
LINEAR_INPUTS = {"wq": (0,), "wk": (0,), "wv": (0,), "wo": (0, 1), "w_gate": (0,), "w_up": (0,), "w_down": (0,)}


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every parameter of one layer and of the top level, by field name."""
    e, h, k, d, f, v = (
        config.hidden_size,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.intermediate_size,
        config.vocab_size,
    )
    shapes = {
        "embed": (v, e),
        "final_norm": (e,),
        "lm_head": (e, v),
        "attn_norm": (e,),
        "wq": (e, h, d),
        "wk": (e, k, d),
        "wv": (e, k, d),
        "wo": (h, d, e),
        "mlp_norm": (e,),
        "w_gate": (e, f),
        "w_up": (e, f),
        "w_down": (f, e),
        "bq": (h, d),
        "bk": (k, d),
        "bv": (k, d),
        "bo": (e,),
        "q_norm": (d,),
        "k_norm": (d,),
        "w_qkv": (e, k, h // k + 2, d),
        "b_qkv": (k, h // k + 2, d),
        "w_gate_up": (e, 2, f),
    }
    return shapes


def layer_fields(config: ModelConfig) -> list[str]:
    """The per-layer tensors a checkpoint of this config has, by our field names (before
    `assemble` fuses q/k/v and gate/up; biases only where the checkpoint has them)."""
    fields = ["attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"]
    if config.qkv_bias:
        fields += ["bq", "bk", "bv"]
    if config.o_bias:
        fields += ["bo"]
    if config.qk_norm:
        fields += ["q_norm", "k_norm"]
    return fields


def top_fields(config: ModelConfig) -> list[str]:
    return ["embed", "final_norm"] + ([] if config.tie_word_embeddings else ["lm_head"])


def assemble(config: ModelConfig, top: L.Fields, per_layer: list[L.Fields]) -> LlamaParams:
    """Builds the parameter tree from arrays keyed by field name, fusing q|k|v and gate|up. Each
    layer's dict is consumed (its unfused arrays popped) as the layer is built, so a load never
    holds the unfused and the fused copies of every layer at once."""
    return LlamaParams(
        embed=top["embed"],
        final_norm=top["final_norm"],
        lm_head=top.get("lm_head"),
        layers=tuple(LlamaLayer(**fuse_gate_up(fuse_qkv(fields))) for fields in per_layer),
    )


def fuse_qkv(fields: L.Fields) -> L.Fields:
    """wq [E, H, D], wk / wv [E, K, D] -> w_qkv [E, K, H/K + 2, D] (biases alike), in place.
    Query head h belongs to KV head h // (H/K)."""
    wq, wk, wv = fields.pop("wq"), fields.pop("wk"), fields.pop("wv")
    k = wk.shape[1]
    fields["w_qkv"] = fuse(  # a quantized weight's scales [1|E/g, H, D] fuse alike
        lambda q, kk, v: jnp.concatenate(
            [q.reshape(q.shape[0], k, -1, q.shape[2]), kk[:, :, None], v[:, :, None]], axis=2
        ),
        wq,
        wk,
        wv,
    )
    if "bq" in fields:
        bq, bk, bv = fields.pop("bq"), fields.pop("bk"), fields.pop("bv")
        fields["b_qkv"] = jnp.concatenate([bq.reshape(k, -1, bq.shape[1]), bk[:, None], bv[:, None]], axis=1)
    return fields


def fuse_gate_up(fields: L.Fields) -> L.Fields:
    """w_gate, w_up [E, F] -> w_gate_up [E, 2, F], in place."""
    fields["w_gate_up"] = fuse(lambda g, u: jnp.stack([g, u], axis=1), fields.pop("w_gate"), fields.pop("w_up"))
    return fields


def random_fields(
    shapes: dict[str, tuple[int, ...]],
    top_names: list[str],
    layer_names: list[str],
    num_layers: int,
    key: jax.Array,
    dtype: DTypeLike,
    scale: float,
    norm_value: float,
) -> tuple[L.Fields, list[L.Fields]]:
    """Random arrays by field name (tests and benchmarks): normal(0, scale), norms filled with
    `norm_value`; one key per array, in field order."""

    def make(name: str, k: jax.Array) -> jax.Array:
        if name.endswith("norm"):
            return jnp.full(shapes[name], norm_value, dtype)
        return (scale * jax.random.normal(k, shapes[name], jnp.float32)).astype(dtype)

    keys = iter(jax.random.split(key, 3 + num_layers * 16))
    top = {name: make(name, next(keys)) for name in top_names}
    per_layer = [{name: make(name, next(keys)) for name in layer_names} for _ in range(num_layers)]
    return top, per_layer


def init_params(
    config: ModelConfig, key: jax.Array, dtype: DTypeLike = jnp.float32, scale: float = 0.02
) -> LlamaParams:
    """Random parameters (for tests and benchmarks): normal(0, scale), norms at 1."""
    top, per_layer = random_fields(
        param_shapes(config), top_fields(config), layer_fields(config), config.num_layers, key, dtype, scale, 1.0
    )
    return assemble(config, top, per_layer)


def attention_block(
    x: jax.Array,
    p: L.AttentionLayer,
    kv_cache: L.KVCache,
    cos: jax.Array,
    sin: jax.Array,
    meta: L.AttentionMetadata[jax.Array],
    config: ModelConfig,
    attn_impl: str,
) -> tuple[jax.Array, L.KVCache]:
    """x [T, E] -> x + attention(norm(x)), and the layer's updated cache. `p` is any layer with
    LlamaLayer's attention fields (attn_norm, w_qkv, wo and the optional b_qkv, bo, q/k_norm)."""
    h = L.rms_norm(x, p.attn_norm, config.rms_norm_eps)  # [T, E]
    qkv = L.project_qkv(h, p.w_qkv)  # [T, K, G+2, D]
    if p.b_qkv is not None:
        qkv = qkv + p.b_qkv
    t, kv_heads, group, d = qkv.shape[0], qkv.shape[1], qkv.shape[2] - 2, qkv.shape[3]
    q = qkv[:, :, :group].reshape(t, kv_heads * group, d)  # [T, H, D]
    k, v = qkv[:, :, group], qkv[:, :, group + 1]  # [T, K, D] each
    if p.q_norm is not None and p.k_norm is not None:  # over head_dim, one weight for all heads (as HF Qwen3)
        q, k = L.rms_norm(q, p.q_norm, config.rms_norm_eps), L.rms_norm(k, p.k_norm, config.rms_norm_eps)
    q, k = L.apply_rope(q, cos, sin), L.apply_rope(k, cos, sin)
    attn, kv_cache = L.paged_attention(q, k, v, kv_cache, meta, config, attn_impl)
    out = einsum("thd,hde->te", attn, p.wo)  # [T, E]
    if p.bo is not None:
        out = out + p.bo
    return x + out, kv_cache


def _layer(
    x: jax.Array,
    p: LlamaLayer,
    kv_cache: L.KVCache,
    cos: jax.Array,
    sin: jax.Array,
    meta: L.AttentionMetadata[jax.Array],
    config: ModelConfig,
    attn_impl: str,
) -> tuple[jax.Array, L.KVCache]:
    x, kv_cache = attention_block(x, p, kv_cache, cos, sin, meta, config, attn_impl)
    h = L.rms_norm(x, p.mlp_norm, config.rms_norm_eps)
    x = x + L.gated_mlp(h, p.w_gate_up, p.w_down)
    return x, kv_cache


def forward(
    params: LlamaParams,
    config: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    kv_caches: tuple[L.KVCache, ...],
    meta: L.AttentionMetadata[jax.Array],
    *,
    attn_impl: str = "auto",
) -> tuple[jax.Array, tuple[L.KVCache, ...]]:
    """tokens, positions i32[T]; kv_caches: one [P, page, 2K, D] array per layer.

    Returns (hidden [T, E] after the final norm, new kv_caches tuple).
    """
    return L.decoder_stack(_layer, params, config, tokens, positions, kv_caches, meta, attn_impl)


# One pipeline tick with a batch on every stage (models/ticks.py).
tick = functools.partial(decoder_tick, _layer)


def compute_logits(params: L.LMHead, hidden: jax.Array) -> jax.Array:
    """hidden [N, E] -> logits f32[N, V]; with LoRA adapters of the LM head (the embedding leaf a
    VocabLora, quant/lora_vocab.py), each row's adapter share added."""
    if params.lm_head is None:
        logits = einsum("ne,ve->nv", hidden, unwrapped(params.embed))
    else:
        logits = einsum("ne,ev->nv", hidden, params.lm_head)
    return head_logits(params.embed, hidden, logits).astype(jnp.float32)
