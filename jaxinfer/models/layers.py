"""Layers shared by the model families: RMSNorm, rotary embeddings, gated MLP, mixture-of-experts
MLP, paged attention.

Every function is pure: parameters and state come in as arguments and go out as results.
Shapes use these letters: T tokens of the ragged batch, E embed, H query heads, K kv heads,
D head dim, F mlp hidden, V vocab, X experts, k experts per token.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Layout, with_layout_constraint

from jaxinfer.config import ModelConfig
from jaxinfer.config.kv_layout import kv_layout
from jaxinfer.quant import einsum
from jaxinfer.quant.kv_cache import QuantizedKVCache
from jaxinfer.quant.lora_vocab import vocab_rows
from pallas_kernels import ragged_paged_attention, split_rows
from sharding import current_mesh, shard_paged_attention
from sharding.stages import num_stages, run_stages

# Parameters by field name as loaded (a layer's, or the top level's): float arrays and quantized
# weights (jaxinfer.quant) side by side, before a family's `assemble` builds its tree.
Fields = dict[str, Any]
KVCache = jax.Array | QuantizedKVCache  # one layer's pages [P, page, 2K, D] (int8 / fp8: and their scales)
# A layer function of the decoder stack: (x, layer, kv_cache, cos, sin, meta, config, attn_impl,
# *static) -> (x, kv_cache).
LayerFn = Callable[..., tuple[jax.Array, KVCache]]


class DecoderParams(Protocol):
    """What the shared layers read of a family's parameter tree (a flax.struct dataclass)."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    @property
    def embed(self) -> jax.Array: ...  # [V, E], maybe quantized
    @property
    def layers(self) -> tuple[Any, ...]: ...  # the family's layer dataclasses
    @property
    def final_norm(self) -> jax.Array: ...  # [E]


@flax.struct.dataclass(frozen=True)  # as flax makes it; said for the type checker: `A` is covariant
class AttentionMetadata[A]:
    """Where this step's tokens sit in the paged KV cache (the kernel contract's metadata).
    `A`: the arrays' type: numpy as the host builds them, jax.Array on the device."""

    kv_lens: A  # i32[S] tokens in the cache per sequence after this step
    # i32[G, S, pages_per_seq]: each layer group's page tables (config/kv_layout.py), or
    # i32[S, pages_per_seq] when every layer has a cache of its own; None from the host (the
    # step reads its page table)
    page_indices: A | None
    cu_q_lens: A  # i32[S+1] query token offsets
    num_seqs: A  # i32[1] real sequences; the rest is padding


class AttentionLayer(Protocol):
    """What llama.model.attention_block reads of a layer: LlamaLayer's attention fields (MoeLayer's too)."""

    @property
    def attn_norm(self) -> jax.Array: ...
    @property
    def w_qkv(self) -> jax.Array: ...
    @property
    def wo(self) -> jax.Array: ...
    @property
    def b_qkv(self) -> jax.Array | None: ...
    @property
    def bo(self) -> jax.Array | None: ...
    @property
    def q_norm(self) -> jax.Array | None: ...
    @property
    def k_norm(self) -> jax.Array | None: ...


class LMHead(Protocol):
    """What llama.model.compute_logits (every family's LM head) reads of the parameters."""

    @property
    def embed(self) -> jax.Array: ...
    @property
    def lm_head(self) -> jax.Array | None: ...


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
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
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


@functools.cache
def traced_once(layer_fn: LayerFn) -> jax.stages.Wrapped:
    """layer_fn(x, layer, kv_cache, cos, sin, meta, config, attn_impl, *static) as a jit of its
    own, config, attn_impl and the rest static: inside the step's jit, layers of one signature are
    traced and lowered once, each layer a call of that one function, and XLA inlines the calls, so
    the compiled step is the same as with the layers written out (SmolLM2's 30 layers: the
    README's first command starts in 115 s instead of 171 s on a 2-core CPU, benchmarks/RESULTS.md)."""
    num_args = len(inspect.signature(layer_fn).parameters)
    return jax.jit(layer_fn, static_argnums=tuple(range(6, num_args)))


def decoder_stack(
    layer_fn: LayerFn,
    params: DecoderParams,
    config: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    kv_caches: tuple[KVCache, ...],
    meta: AttentionMetadata[jax.Array],
    attn_impl: str,
) -> tuple[jax.Array, tuple[KVCache, ...]]:
    """Embedding, then `layer_fn(x, layer, kv_cache, cos, sin, meta, config, attn_impl)` for each
    layer in order (each writes its K/V pages), then the final norm: (hidden [T, E], caches)."""
    x = vocab_rows(params.embed, tokens)  # [T, E]; a quantized embedding dequantizes these rows
    cos, sin = rope_cos_sin(positions, rope_inv_freq(config))
    layer_call = traced_once(layer_fn)
    if num_stages(current_mesh()) > 1:  # pipeline stages: each runs its slots (sharding/stages.py)

        def slot(j: int, x: jax.Array, layer: Any, cache: KVCache, extras: tuple) -> tuple[jax.Array, KVCache]:
            cos, sin, meta = extras  # one group of layers: its page table
            return layer_call(x, layer, cache, cos, sin, group_meta(meta, 0), config, attn_impl)

        x, staged = run_stages(slot, x, params.layers, kv_caches, (cos, sin, meta))
        return rms_norm(x, params.final_norm, config.rms_norm_eps), staged
    caches = list(kv_caches)
    for i, layer in enumerate(params.layers):
        c, layer_meta = layer_kv(config, caches, meta, i)
        x, caches[c] = layer_call(x, layer, caches[c], cos, sin, layer_meta, config, attn_impl)
    return rms_norm(x, params.final_norm, config.rms_norm_eps), tuple(caches)


def layer_kv(
    config: ModelConfig, kv_caches: list[KVCache], meta: AttentionMetadata[jax.Array], layer: int
) -> tuple[int, AttentionMetadata[jax.Array]]:
    """Which of `kv_caches` layer `layer` reads and writes, and the metadata with its group's page
    table. One cache per layer: the layer's own, and the one table (the plain layout, and how
    tests and KV calibration call a forward); fewer caches: the model's KV layout
    (config/kv_layout.py), page_indices [G, S, P] holding each group's tables."""
    pages = meta.page_indices
    if len(kv_caches) == config.num_layers:
        group, cache = 0, layer
    else:
        layout = kv_layout(config)
        if len(kv_caches) != layout.num_caches or (pages is not None and pages.ndim != 3):
            raise ValueError(
                f"{len(kv_caches)} KV caches and page tables of shape {None if pages is None else pages.shape} "
                f"for {config.num_layers} layers in {layout.num_groups} groups of {layout.num_caches}"
            )
        group, cache = layout.slot(layer)
    return cache, group_meta(meta, group)


def group_meta(meta: AttentionMetadata[jax.Array], group: int) -> AttentionMetadata[jax.Array]:
    """The metadata with group `group`'s page tables (of page_indices [G, S, P], where given so)."""
    pages = meta.page_indices
    return dataclasses.replace(meta, page_indices=pages[group]) if pages is not None and pages.ndim == 3 else meta


def project_qkv(x: jax.Array, w_qkv: jax.Array) -> jax.Array:
    """x [T, E] -> q|k|v [T, K, G+2, D] in one matmul (w_qkv [E, K, G+2, D], maybe quantized),
    its output pinned row-major. Left free, XLA:TPU may give this product a transposed output
    when the attention kernels rearrange q (seen in the step vmapped over data replicas), and
    then relays the whole weight to the layout such a product reads, on every step; pinned, the
    weight is read as placed (sharding/weight_layout.py) and only the small output is moved.
    XLA:CPU and XLA:GPU lay a dot's output out row-major anyway."""
    qkv = einsum("te,ekjd->tkjd", x, w_qkv)
    return with_layout_constraint(qkv, Layout(major_to_minor=tuple(range(qkv.ndim))))


def gated_mlp(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """x [T, E] -> [T, E]: down(silu(gate(x)) * up(x)), gate and up in one matmul (w_gate_up
    [E, 2, F]); either weight may be quantized (jaxinfer.quant)."""
    gate_up = einsum("te,ecf->tcf", x, w_gate_up)  # [T, 2, F]
    return einsum("tf,fe->te", jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1], w_down)


def paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_cache: KVCache,
    meta: AttentionMetadata[jax.Array],
    config: ModelConfig,
    impl: str,
    sliding: bool = True,
) -> tuple[jax.Array, KVCache]:
    """q [T, H, D], k/v [T, K, D] -> (out [T, H, D], kv_cache) via the ragged paged kernel; the
    cache is a float array or an int8/fp8 QuantizedKVCache (jaxinfer.quant.kv_cache).

    Under a mesh (jax.set_mesh) the kernel runs once per shard: heads split over `tensor`,
    tokens over `sequence` (see sharding/attention.py); without one it is a plain call. `sliding`:
    False for a global layer of a model whose layers differ (config.layer_types)."""
    if meta.page_indices is None:
        raise ValueError("paged_attention: the metadata has no page_indices (the step reads them from its page table)")
    window = config.sliding_window if sliding else None
    attend = functools.partial(
        ragged_paged_attention,
        sm_scale=config.attn_scale,
        sliding_window=window,
        soft_cap=config.attn_logit_softcap,
        impl=impl,
    )
    attend_rows = functools.partial(
        split_rows.attend_rows, sm_scale=config.attn_scale, sliding_window=window, soft_cap=config.attn_logit_softcap
    )
    return shard_paged_attention(
        _with_kv_scales(attend),
        _with_kv_scales(attend_rows),
        q,
        k,
        v,
        kv_cache,
        meta.kv_lens,
        meta.page_indices,
        meta.cu_q_lens,
        meta.num_seqs,
    )


def _with_kv_scales(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A call fn(q, k, v, cache, ...) -> (out, cache) that also takes a QuantizedKVCache: its
    pages go in as the cache and its per-head scales as k_scale / v_scale, so new K/V are written
    quantized and pages are read back dequantized; the cache comes back with the same scales."""

    def call(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache, *rest: Any) -> Any:
        if not isinstance(cache, QuantizedKVCache):
            return fn(q, k, v, cache, *rest)
        out, pages = fn(q, k, v, cache.pages, *rest, k_scale=cache.k_scale, v_scale=cache.v_scale)
        return out, dataclasses.replace(cache, pages=pages)

    return call
