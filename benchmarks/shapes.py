"""Real model shapes with random weights, built on the device (no download, no transformers).

    model = random_model("llama-3.1-8b", dtype="bfloat16")   # a LoadedModel for Engine / LLM
    hf_config("llama-3.2-1b")   # the same shape for HF transformers (bench_engine --hf-python)

Weights are normal(0, 0.02) drawn by the family's init_params (fused q|k|v and gate|up as the
loader builds them); outputs are meaningless, speeds are not. Token-id prompts only (no tokenizer).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig, RopeScaling
from jaxinfer.config.sources import pattern_layer_types
from jaxinfer.loader import LoadedModel
from jaxinfer.models.reading import resolve_dtype
from jaxinfer.models.registry import get_family
from jaxinfer.quant.inspect import param_bytes as quant_param_bytes
from jaxinfer.quant.inspect import param_count
from jaxinfer.quant.weights import QuantizedWeight

_LLAMA3_ROPE = dict(rope_theta=500000.0, max_position_embeddings=131072)
SHAPES = {
    "smollm2": ModelConfig(
        model_type="llama",
        family="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    # SmolLM2 with Mixtral's routing: 8 experts of width 768, top 2, so the active MLP width (2 x 768)
    # equals SmolLM2's dense 1536 (benchmarks/bench_moe.py sets the two side by side).
    "smollm2-moe": ModelConfig(
        model_type="mixtral",
        family="moe",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=768,
        norm_topk_prob=True,
    ),
    "llama-3.2-1b": ModelConfig(
        model_type="llama",
        family="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_scaling=RopeScaling("llama3", 32.0, 1.0, 4.0, 8192),
        **_LLAMA3_ROPE,
    ),
    "qwen3-30b-a3b": ModelConfig(
        model_type="qwen3_moe",
        family="moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        qk_norm=True,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
    ),
    # Gemma 3 1B: head_dim 256, one KV head, five sliding-window (512) layers to each global one.
    "gemma-3-1b": ModelConfig(
        model_type="gemma3_text",
        family="gemma",
        vocab_size=262144,
        hidden_size=1152,
        intermediate_size=6912,
        num_layers=26,
        num_heads=4,
        num_kv_heads=1,
        head_dim=256,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        rope_local_theta=10000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        qk_norm=True,
        sliding_window=512,
        layer_types=pattern_layer_types(26, 6),
        query_pre_attn_scalar=256.0,
    ),
    "llama-3.1-8b": ModelConfig(
        model_type="llama",
        family="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
        **_LLAMA3_ROPE,
    ),
    # The larger Llama 3.1 shapes (their published configs), for memory plans over many chips
    # (tpu_aot.py --plan-only): models no one host's chips hold.
    "llama-3.1-70b": ModelConfig(
        model_type="llama",
        family="llama",
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
        **_LLAMA3_ROPE,
    ),
    "llama-3.1-405b": ModelConfig(
        model_type="llama",
        family="llama",
        vocab_size=128256,
        hidden_size=16384,
        intermediate_size=53248,
        num_layers=126,
        num_heads=128,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
        **_LLAMA3_ROPE,
    ),
}


def shape_config(shape: str, num_layers: int | None = None) -> ModelConfig:
    """The shape's config, or its first `num_layers` layers (their layer types kept)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {sorted(SHAPES)}")
    config = SHAPES[shape]
    if num_layers is None:
        return config
    return dataclasses.replace(config, num_layers=num_layers, layer_types=config.layer_types[:num_layers])


def random_model(
    shape: str,
    dtype: str = "auto",
    seed: int = 0,
    quantization: str | None = None,
    group_size: int = 64,
    num_layers: int | None = None,
) -> LoadedModel:
    """`quantization` "int8" | "int4" quantizes every fused linear weight on the device (the layout
    the loader makes from a checkpoint with `quantization=`), without a float copy on the host;
    `num_layers` keeps only the first layers of the shape (quick runs)."""
    config = shape_config(shape, num_layers)
    params = _init_by_layer(config, resolve_dtype(dtype), jax.random.key(seed))
    if quantization not in (None, "none"):
        params = _quantize_layers(params, quantization, group_size)
    return LoadedModel(config, params, None, get_family(config.family), Path(f"random:{shape}"))


def _init_by_layer(config: ModelConfig, dtype, key):
    """The family's init_params, one layer per jitted call (one compile, reused): a whole model in
    one call keeps every layer's float32 draws alive at once (a 30B shape did not finish in 8 min).
    Only the first call draws the embedding and LM head (the Qwen3-30B-A3B shape's are 0.6 G
    parameters, half of what each of its layers' calls drew before; 112 s on an H200)."""
    family = get_family(config.family)
    kinds = {}  # per layer kind (dense or mixture of experts): a jitted one-layer init

    def one_layer(i, vocab_size=8):  # the layer alone: a vocabulary of 8 keeps the tables small
        moe = config.is_moe_layer(i) if config.num_experts else False
        if (moe, vocab_size) not in kinds:
            one = dataclasses.replace(config, num_layers=1, layer_types=config.layer_types[:1], vocab_size=vocab_size)
            if config.num_experts:
                one = dataclasses.replace(one, mlp_only_layers=() if moe else (0,), decoder_sparse_step=1)
            kinds[moe, vocab_size] = jax.jit(lambda k, one=one: family.init_params(one, k, dtype))
        return kinds[moe, vocab_size]

    keys = jax.random.split(key, config.num_layers)
    first = one_layer(0, config.vocab_size)(keys[0])  # with the model's embedding (and LM head)
    layers = [first.layers[0]] + [one_layer(i)(keys[i]).layers[0] for i in range(1, config.num_layers)]
    return first.replace(layers=tuple(layers))


# The fused linear fields of a layer and their input (contracted) axes.
_FUSED_INPUTS = {
    "w_qkv": (0,),
    "wo": (0, 1),
    "w_gate_up": (0,),
    "w_down": (0,),
    "experts_gate_up": (1,),
    "experts_down": (1,),
}  # stacked [X, E, 2, F], [X, F, E]


def _quantize_layers(params, method: str, group: int):
    if method not in ("int8", "int4"):
        raise ValueError(f"quantization={method!r}: expected int8, int4 or none")

    def one(w, inputs):
        fn = jax.jit(_int8 if method == "int8" else functools.partial(_int4, group=group), static_argnums=1)
        return fn(w, inputs)

    layers = []
    for layer in params.layers:
        fields = {
            f: one(getattr(layer, f), ins) for f, ins in _FUSED_INPUTS.items() if getattr(layer, f, None) is not None
        }
        layers.append(layer.replace(**fields))
    return params.replace(layers=tuple(layers))


def _int8(w, inputs):
    amax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=inputs, keepdims=True)
    scales = jnp.where(amax > 0, amax / 127.0, 1.0)
    values = jnp.clip(jnp.rint(w / scales), -127, 127).astype(jnp.int8)
    return QuantizedWeight(values, scales.astype(w.dtype), None, "int8", inputs)


def _int4(w, inputs, group):  # as quant.weights.quantize_int4: w ~ q * s + group minimum
    axis, n = inputs[-1], w.shape[inputs[-1]]
    grouped = w.astype(jnp.float32).reshape(w.shape[:axis] + (n // group, group) + w.shape[axis + 1 :])
    lo = grouped.min(axis=axis + 1, keepdims=True)
    hi = grouped.max(axis=axis + 1, keepdims=True)
    scales = jnp.where(hi > lo, (hi - lo) / 15, 1.0)
    q = jnp.clip(jnp.rint((grouped - lo) / scales), 0, 15).astype(jnp.uint8).reshape(w.shape)
    q = jnp.moveaxis(q, axis, 0)
    packed = jnp.moveaxis(q[0::2] | (q[1::2] << 4), 0, axis)  # the even input in the low nibble
    squeeze = lambda a: jnp.squeeze(a, axis + 1).astype(w.dtype)  # noqa: E731
    return QuantizedWeight(packed, squeeze(scales), None, "int4", inputs, group, offsets=squeeze(lo))


def hf_config(shape: str) -> dict:
    """The shape as a HF `LlamaConfig` dict (for benchmarks/hf_baseline.py --shape-config)."""
    c = SHAPES[shape]
    if c.family != "llama" or c.model_type != "llama":
        raise ValueError(f"shape {shape!r} ({c.model_type}): only Llama shapes have an HF baseline here")
    out = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if c.rope_scaling is not None:
        r = c.rope_scaling
        out["rope_scaling"] = {
            "rope_type": r.rope_type,
            "factor": r.factor,
            "low_freq_factor": r.low_freq_factor,
            "high_freq_factor": r.high_freq_factor,
            "original_max_position_embeddings": r.original_max_position_embeddings,
        }
    return out


def param_bytes(model: LoadedModel) -> int:
    return quant_param_bytes(model.params)


def kv_bytes_per_token(config: ModelConfig, dtype) -> int:
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * jnp.dtype(dtype).itemsize


def decode_floor_s(model: LoadedModel, batch: int, context: int, copy_rate: float) -> float:
    """The least time a decode step can take: every weight a step uses and every context token's
    K/V read once (a mixture of experts reads at most batch x top-k of its experts; an embedding
    table apart from the LM head is read a row per token, which the floor leaves out)."""
    kv = kv_bytes_per_token(model.config, model.params.embed.dtype) * batch * context
    weights, c = param_bytes(model) - quant_param_bytes(_untied_embedding(model)), model.config
    if c.num_experts:
        weights -= quant_param_bytes(_experts(model)) * max(0.0, 1 - batch * c.num_experts_per_tok / c.num_experts)
    return (weights + kv) / copy_rate  # bytes moved per second, as copies measure it


def _experts(model: LoadedModel) -> list:
    """Every layer's expert weights (none for a dense model)."""
    return [
        (getattr(layer, "experts_gate_up", None), getattr(layer, "experts_down", None)) for layer in model.params.layers
    ]


def _untied_embedding(model: LoadedModel) -> list:
    """The embedding table where the LM head is a separate weight (a lookup, no matmul); else none."""
    return [] if getattr(model.params, "lm_head", None) is None else [model.params.embed]


def active_param_count(model: LoadedModel) -> int:
    """Parameters one token's forward multiplies by: a mixture of experts runs num_experts_per_tok
    of its num_experts expert MLPs per token; an untied embedding table is only looked up."""
    params, c = param_count(model.params) - param_count(_untied_embedding(model)), model.config
    if c.num_experts:
        params -= param_count(_experts(model)) * (1 - c.num_experts_per_tok / c.num_experts)
    return int(params)


def prefill_floor_s(model: LoadedModel, tokens: int, matmul_rate: float) -> float:
    """2 FLOPs per active parameter per token (attention's own FLOPs aside)."""
    return 2 * active_param_count(model) * tokens / matmul_rate
