"""Writes small GGUF files for tests: HF-layout tensors in, llama.cpp conventions out."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np


def permute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF half-split rotary rows -> llama.cpp interleaved pairs (what its converter does)."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    path: Path,
    arch: str,
    metadata: dict,
    tensors: dict[str, np.ndarray],
    qtypes: dict[str, gguf.GGMLQuantizationType] | None = None,
) -> Path:
    """tensors: name -> float32 array in HF row-major shape; qtypes: name -> storage type."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, array in tensors.items():
        qtype = (qtypes or {}).get(name, gguf.GGMLQuantizationType.F32)
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(array, np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, np.ascontiguousarray(array, np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(array.astype(np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_hf_to_gguf(config: dict, hf_tensors: dict[str, np.ndarray], arch: str = "llama") -> tuple[dict, dict]:
    """Metadata and GGUF-named tensors for an HF Llama-like checkpoint (as llama.cpp converts it:
    q/k rows permuted into interleaved rotary pairs for the "llama" architecture only; Qwen3's
    QK-norm weights as attn_q_norm / attn_k_norm)."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    rope = config.get("rope_parameters") or {"rope_theta": config.get("rope_theta", 10000.0)}
    meta = {
        f"{arch}.{key}": value
        for key, value in {
            "block_count": config["num_hidden_layers"],
            "context_length": config["max_position_embeddings"],
            "embedding_length": config["hidden_size"],
            "feed_forward_length": config["intermediate_size"],
            "attention.head_count": heads,
            "attention.head_count_kv": kv_heads,
            "attention.key_length": config.get("head_dim") or config["hidden_size"] // heads,
            "rope.freq_base": float(rope["rope_theta"]),
            "attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
            "vocab_size": config["vocab_size"],
        }.items()
    }
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
    }
    out = {}
    for name, w in hf_tensors.items():
        if name in names:
            out[names[name]] = w
            continue
        i, rest = name.removeprefix("model.layers.").split(".", 1)
        if arch == "llama" and rest == "self_attn.q_proj.weight":
            w = permute_rope(w, heads)
        elif arch == "llama" and rest == "self_attn.k_proj.weight":
            w = permute_rope(w, kv_heads)
        out[f"blk.{i}.{layer[rest]}"] = w
    return meta, out


# Mixtral and Qwen3-MoE per-expert HF names -> (router name, per-expert module, gate/up/down names)
_HF_MOE = {
    "mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp.gate", "mlp.experts", ("gate_proj", "up_proj", "down_proj")),
}


def moe_hf_to_gguf(config: dict, hf_tensors: dict[str, np.ndarray], arch: str) -> tuple[dict, dict]:
    """As llama.cpp converts Mixtral (arch "llama") and Qwen3-MoE (arch "qwen3moe"): the router as
    blk.N.ffn_gate_inp, each projection's experts stacked into blk.N.ffn_{gate,up,down}_exps, the
    expert counts and width in the metadata (and expert_weights_norm, which llama.cpp assumes true)."""
    router, experts, names = _HF_MOE[config["model_type"]]
    moe = {name: w for name, w in hf_tensors.items() if f".{router}." in name or f".{experts}." in name}
    meta, out = llama_hf_to_gguf(config, {n: w for n, w in hf_tensors.items() if n not in moe}, arch)
    count = config.get("num_experts") or config["num_local_experts"]
    meta.update(
        {
            f"{arch}.expert_count": count,
            f"{arch}.expert_used_count": config["num_experts_per_tok"],
            f"{arch}.expert_feed_forward_length": config.get("moe_intermediate_size") or config["intermediate_size"],
            f"{arch}.expert_weights_norm": bool(config.get("norm_topk_prob", True)),
        }
    )
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        if prefix + router + ".weight" not in moe:
            continue
        out[f"blk.{i}.ffn_gate_inp.weight"] = moe[prefix + router + ".weight"]
        for gguf_name, hf_name in zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), names):
            out[f"blk.{i}.{gguf_name}.weight"] = np.stack(
                [moe[f"{prefix}{experts}.{j}.{hf_name}.weight"] for j in range(count)]
            )
    return meta, out
