"""Layers shared by the model families: RMSNorm, rotary embeddings, gated MLP, mixture-of-experts
MLP, paged attention.

Every function is pure: parameters and state come in as arguments and go out as results.
Shapes use these letters: T tokens of the ragged batch, E embed, H query heads, K kv heads,
D head dim, F mlp hidden, V vocab, X experts, k experts per token.
"""
from __future__ import annotations

import functools
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.quant import einsum
from pallas_kernels import ragged_paged_attention
from pallas_kernels.reference import write_kv
from sharding import shard_paged_attention


@flax.struct.dataclass
class AttentionMetadata:
    """Where this step's tokens sit in the paged KV cache (the kernel contract's metadata)."""

    kv_lens: jax.Array  # i32[S] tokens in the cache per sequence after this step
    page_indices: jax.Array  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array  # i32[S+1] query token offsets
    num_seqs: jax.Array  # i32[1] real sequences; the rest is padding


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., E]: normalise in float32, scale in the activation dtype (as HF Llama does)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * y.astype(x.dtype)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies [D/2] in float32, with linear or llama3 scaling applied."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float32) / d))
    inv_freq = inv_freq.astype(np.float32)
    if config.rope_freq_factors is not None:  # llama.cpp's form of llama3 scaling
        return (inv_freq / np.asarray(config.rope_freq_factors, np.float32)).astype(np.float32)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return (inv_freq / scaling.factor).astype(np.float32)
    # llama3: long wavelengths divided by `factor`, short ones kept, a smooth blend between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """positions i32[T] -> cos, sin f32[T, D] in the half-split (rotate_half) layout."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, H, D]; rotates pairs (i, i + D/2)."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)


def decoder_stack(layer_fn, params, config: ModelConfig, tokens: jax.Array, positions: jax.Array,
                  kv_caches, meta: AttentionMetadata, attn_impl: str):
    """Embedding, then `layer_fn(x, layer, kv_cache, cos, sin, meta, config, attn_impl)` for each
    layer in order (each writes its K/V pages), then the final norm: (hidden [T, E], caches)."""
    x = params.embed[tokens]  # [T, E]
    cos, sin = rope_cos_sin(positions, rope_inv_freq(config))
    new_caches = []
    for layer, kv_cache in zip(params.layers, kv_caches):
        x, kv_cache = layer_fn(x, layer, kv_cache, cos, sin, meta, config, attn_impl)
        new_caches.append(kv_cache)
    return rms_norm(x, params.final_norm, config.rms_norm_eps), tuple(new_caches)


def gated_mlp(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """x [T, E] -> [T, E]: down(silu(gate(x)) * up(x)), gate and up in one matmul (w_gate_up
    [E, 2, F]); either weight may be quantized (jaxinfer.quant)."""
    gate_up = einsum("te,ecf->tcf", x, w_gate_up)  # [T, 2, F]
    return einsum("tf,fe->te", jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1], w_down)


def route(x: jax.Array, router: jax.Array, top_k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """x [T, E], router [E, X] -> (weights [T, k] in x's dtype, expert ids i32[T, k]): softmax over
    all X router logits in float32, the top k kept, renormalised to sum to 1 if asked (Mixtral
    always: the same as a softmax over the top-k logits; Qwen3-MoE per norm_topk_prob)."""
    logits = jnp.einsum("te,ex->tx", x.astype(jnp.float32), router.astype(jnp.float32))  # [T, X]
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)  # [T, k] each
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(x.dtype), experts


def moe_mlp(x: jax.Array, router: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, *, top_k: int,
            renormalize: bool, impl: str = "auto") -> jax.Array:
    """x [T, E] -> [T, E]: each token's top-k experts' gated MLPs (w_gate_up [X, E, 2, F], w_down
    [X, F, E]) summed with the router's weights. impl "ragged": tokens sorted by expert, grouped
    matmuls (`lax.ragged_dot`) doing k/X of the dense work; "dense": every expert on every token,
    weighted by a [T, X] matrix that is zero off the top k (on the CPU ragged_dot is lowered to
    about that dense work plus masking and measured ~2x slower); "auto": dense on the CPU."""
    weights, experts = route(x, router, top_k, renormalize)
    if impl == "auto":
        impl = "dense" if jax.default_backend() == "cpu" else "ragged"
    if impl == "dense":
        combine = jnp.einsum("tkx,tk->tx", jax.nn.one_hot(experts, router.shape[1], dtype=x.dtype), weights)
        gate_up = jnp.einsum("te,xecf->txcf", x, w_gate_up)  # [T, X, 2, F]
        hidden = jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1]  # [T, X, F]
        return jnp.einsum("txf,xfe,tx->te", hidden, w_down, combine)
    if impl != "ragged":
        raise ValueError(f"unknown MoE impl {impl!r}; known: 'auto', 'dense', 'ragged'")
    t, num_experts = x.shape[0], router.shape[1]
    flat = experts.reshape(-1)  # [T*k]: row j is token j // k's (j % k)-th choice
    order = jnp.argsort(flat, stable=True)  # rows grouped by expert
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [X]
    xs = x[order // top_k]  # [T*k, E]
    gate = jax.lax.ragged_dot(xs, w_gate_up[:, :, 0], group_sizes)  # [T*k, F]
    up = jax.lax.ragged_dot(xs, w_gate_up[:, :, 1], group_sizes)
    out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down, group_sizes)  # [T*k, E], sorted
    out = jnp.zeros_like(out).at[order].set(out).reshape(t, top_k, -1)  # back to token order
    return jnp.einsum("tke,tk->te", out, weights)


def paged_attention(q: jax.Array, k: jax.Array, v: jax.Array, kv_cache: jax.Array, meta: AttentionMetadata,
                    config: ModelConfig, impl: str) -> tuple[jax.Array, jax.Array]:
    """q [T, H, D], k/v [T, K, D] -> (out [T, H, D], kv_cache) via the ragged paged kernel.

    Under a mesh (jax.set_mesh) the kernel runs once per shard: heads split over `tensor`,
    tokens over `sequence` (see sharding/attention.py); without one it is a plain call."""
    attend = functools.partial(ragged_paged_attention, sm_scale=config.head_dim ** -0.5,
                               sliding_window=config.sliding_window, impl=impl)
    return shard_paged_attention(attend, write_kv, q, k, v, kv_cache, meta.kv_lens,
                                 meta.page_indices, meta.cu_q_lens, meta.num_seqs)
