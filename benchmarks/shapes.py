"""Real model shapes with random weights, built on the device (no download, no transformers).

    model = random_model("llama-3.1-8b", dtype="bfloat16")   # a LoadedModel for Engine / LLM
    hf_config("llama-3.2-1b")   # the same shape for HF transformers (bench_engine --hf-python)

Weights are normal(0, 0.02) drawn by the family's init_params (fused q|k|v and gate|up as the
loader builds them); outputs are meaningless, speeds are not. Token-id prompts only (no tokenizer).
"""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig, RopeScaling
from jaxinfer.loader import LoadedModel, resolve_dtype
from jaxinfer.models.registry import get_family

_LLAMA3_ROPE = dict(rope_theta=500000.0, max_position_embeddings=131072)
SHAPES = {
    "smollm2": ModelConfig(model_type="llama", family="llama", vocab_size=49152, hidden_size=576,
                           intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                           head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                           max_position_embeddings=8192, tie_word_embeddings=True),
    "llama-3.2-1b": ModelConfig(model_type="llama", family="llama", vocab_size=128256, hidden_size=2048,
                                intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
                                head_dim=64, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                rope_scaling=RopeScaling("llama3", 32.0, 1.0, 4.0, 8192), **_LLAMA3_ROPE),
    "llama-3.1-8b": ModelConfig(model_type="llama", family="llama", vocab_size=128256, hidden_size=4096,
                                intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                                head_dim=128, rms_norm_eps=1e-5,
                                rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), **_LLAMA3_ROPE),
}


def random_model(shape: str, dtype: str = "auto", seed: int = 0) -> LoadedModel:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {sorted(SHAPES)}")
    config, family = SHAPES[shape], get_family("llama")
    init = jax.jit(lambda key: family.init_params(config, key, resolve_dtype(dtype)))
    return LoadedModel(config, init(jax.random.key(seed)), None, family, Path(f"random:{shape}"))


def hf_config(shape: str) -> dict:
    """The shape as a HF `LlamaConfig` dict (for benchmarks/hf_baseline.py --shape-config)."""
    c = SHAPES[shape]
    out = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
           "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
           "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
           "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
           "max_position_embeddings": c.max_position_embeddings,
           "tie_word_embeddings": c.tie_word_embeddings, "bos_token_id": 1, "eos_token_id": 2}
    if c.rope_scaling is not None:
        r = c.rope_scaling
        out["rope_scaling"] = {"rope_type": r.rope_type, "factor": r.factor,
                               "low_freq_factor": r.low_freq_factor, "high_freq_factor": r.high_freq_factor,
                               "original_max_position_embeddings": r.original_max_position_embeddings}
    return out


def param_bytes(model: LoadedModel) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(model.params))


def kv_bytes_per_token(config: ModelConfig, dtype) -> int:
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * jnp.dtype(dtype).itemsize


def decode_floor_s(model: LoadedModel, batch: int, context: int, copy_rate: float) -> float:
    """The least time a decode step can take: every weight and every context token's K/V read once."""
    kv = kv_bytes_per_token(model.config, model.params.embed.dtype) * batch * context
    return (param_bytes(model) + kv) / copy_rate  # bytes moved per second, as copies measure it


def prefill_floor_s(model: LoadedModel, tokens: int, matmul_rate: float) -> float:
    """2 FLOPs per parameter per token (attention's own FLOPs aside)."""
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(model.params))
    return 2 * params * tokens / matmul_rate
