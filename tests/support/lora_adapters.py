"""Random LoRA adapters in PEFT's on-disk format, for the LoRA parity tests.

`write_random_adapter` writes a directory exactly as PEFT's `save_pretrained` writes one for a
`LlamaForCausalLM` (PEFT 0.21.2, `task_type="CAUSAL_LM"`): `adapter_config.json` (every key PEFT
writes, `indent=2, sort_keys=True`, no trailing newline) and `adapter_model.safetensors` holding,
for each layer i and target module m, float32

    base_model.model.model.layers.{i}.{self_attn|mlp}.{m}.lora_A.weight   [r, in_features]
    base_model.model.model.layers.{i}.{self_attn|mlp}.{m}.lora_B.weight   [out_features, r]

and for the embedding and the LM head, when targeted,

    base_model.model.model.embed_tokens.lora_embedding_A   [r, vocab]
    base_model.model.model.embed_tokens.lora_embedding_B   [hidden, r]
    base_model.model.lm_head.lora_A.weight                 [r, hidden]
    base_model.model.lm_head.lora_B.weight                 [vocab, r]

with metadata {"format": "pt"} (without the copies of their base weights PEFT adds by default:
save_embedding_layers=False). PEFT adds `scaling * B @ A` to the module's weight, where scaling is
lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora.

tools/make_lora_reference.py (Python 3.11, torch + PEFT) loads such an adapter with
`PeftModel.from_pretrained` to prove the format is PEFT's, and records SmolLM2-135M goldens for
one (tests/fixtures/lora/smollm2_r16.json, with the arguments used); the tests (Python 3.12, no
torch) call this module with those arguments to regenerate the identical adapter instead of
committing it. Depends on numpy, safetensors and json only.

The weights are deterministic given the seed: `numpy.random.default_rng(seed)` draws, for layer 0,
1, ... and within a layer for each module in `target_modules` order, A then B, then the embedding's
and the LM head's (float64 standard normals, cast to float32): A with std 1/sqrt(in_features), so
A @ x keeps the size of x, and B with std scale/sqrt(r), so the branch B @ A @ x is about `scale`
times x (before PEFT's scaling; the embedding's A is a lookup, std 1, its B a tenth of that).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

# Where each Llama projection sits in a decoder layer (PEFT keeps the module path in the name).
LLAMA_MODULE_PARENTS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
VOCAB_NAMES = {  # the embedding's and the LM head's A and B, as PEFT names them
    "embed_tokens": (
        "base_model.model.model.embed_tokens.lora_embedding_A",
        "base_model.model.model.embed_tokens.lora_embedding_B",
    ),
    "lm_head": ("base_model.model.lm_head.lora_A.weight", "base_model.model.lm_head.lora_B.weight"),
}
PEFT_VERSION = "0.21.2"  # the PEFT whose save_pretrained output this matches key for key
DEFAULT_SCALE = 0.3  # SmolLM2-135M: 0.3 changes its answer, 0.5 turns it into noise


def lora_tensor_name(layer: int, module: str, which: str) -> str:
    """PEFT's saved name of one LoRA matrix of a LlamaForCausalLM (which: "lora_A" or "lora_B")."""
    return f"base_model.model.model.layers.{layer}.{LLAMA_MODULE_PARENTS[module]}.{module}.{which}.weight"


def adapter_config(
    *,
    target_modules: Sequence[str],
    r: int,
    lora_alpha: float,
    use_rslora: bool,
    base_model_name_or_path: str,
) -> dict[str, Any]:
    """adapter_config.json as PEFT 0.21.2 saves LoraConfig(r, lora_alpha, use_rslora, target_modules,
    init_lora_weights=False, lora_dropout=0.0, task_type="CAUSAL_LM"); target_modules sorted (PEFT
    keeps them in a set and writes its iteration order, which varies with the hash seed)."""
    return {
        "alora_invocation_tokens": None,
        "alpha_pattern": {},
        "arrow_config": None,
        "auto_mapping": None,
        "base_model_name_or_path": base_model_name_or_path,
        "bias": "none",
        "corda_config": None,
        "ensure_weight_tying": False,
        "eva_config": None,
        "exclude_modules": None,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": False,
        "kasa_config": None,
        "layer_replication": None,
        "layers_pattern": None,
        "layers_to_transform": None,
        "loftq_config": {},
        "lora_alpha": lora_alpha,
        "lora_bias": False,
        "lora_dropout": 0.0,
        "lora_ga_config": None,
        "megatron_config": None,
        "megatron_core": "megatron.core",
        "modules_to_save": None,
        "monteclora_config": None,
        "peft_type": "LORA",
        "peft_version": PEFT_VERSION,
        "qalora_group_size": 16,
        "r": r,
        "rank_pattern": {},
        "revision": None,
        "target_modules": sorted(target_modules),
        "target_parameters": None,
        "task_type": "CAUSAL_LM",
        "trainable_token_indices": None,
        "use_bdlora": None,
        "use_dora": False,
        "use_qalora": False,
        "use_rslora": use_rslora,
        "velora_config": None,
    }


def random_lora_weights(
    *,
    num_layers: int,
    dims: Mapping[str, Sequence[int]],
    target_modules: Sequence[str],
    r: int,
    seed: int,
    scale: float = DEFAULT_SCALE,
) -> dict[str, np.ndarray]:
    """The adapter's tensors by PEFT name (see the module docstring for the draw order)."""
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}

    def draw(module: str) -> tuple[np.ndarray, np.ndarray]:
        in_features, out_features = (int(d) for d in dims[module])
        if module == "embed_tokens":  # a token picks one column of A: keep B @ A[:, t] about `scale`
            a = rng.standard_normal((r, in_features))
            b = rng.standard_normal((out_features, r)) * (scale / math.sqrt(r) / 10)
        else:
            a = rng.standard_normal((r, in_features)) / math.sqrt(in_features)
            b = rng.standard_normal((out_features, r)) * (scale / math.sqrt(r))
        return a.astype(np.float32), b.astype(np.float32)

    for layer in range(num_layers):
        for module in target_modules:
            if module in LLAMA_MODULE_PARENTS:
                a, b = draw(module)
                tensors[lora_tensor_name(layer, module, "lora_A")] = a
                tensors[lora_tensor_name(layer, module, "lora_B")] = b
    for module, names in VOCAB_NAMES.items():
        if module in target_modules:
            tensors[names[0]], tensors[names[1]] = draw(module)
    return tensors


def write_random_adapter(
    path: str | PathLike[str],
    *,
    num_layers: int,
    dims: Mapping[str, Sequence[int]],
    target_modules: Sequence[str],
    r: int,
    lora_alpha: float,
    use_rslora: bool,
    seed: int,
    base_model_name_or_path: str = "base",
    scale: float = DEFAULT_SCALE,
) -> Path:
    """Writes a random PEFT LoRA adapter for a LlamaForCausalLM into the directory `path` (created
    if missing) and returns it. dims: module name -> (in_features, out_features), for at least the
    target modules (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)."""
    unknown = sorted(set(target_modules) - set(LLAMA_MODULE_PARENTS) - set(VOCAB_NAMES))
    if unknown:
        raise ValueError(f"unknown target modules {unknown}; known: {sorted([*LLAMA_MODULE_PARENTS, *VOCAB_NAMES])}")
    if len(set(target_modules)) != len(target_modules):
        raise ValueError(f"repeated target modules: {list(target_modules)}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = random_lora_weights(
        num_layers=num_layers, dims=dims, target_modules=target_modules, r=r, seed=seed, scale=scale
    )
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = adapter_config(
        target_modules=target_modules,
        r=r,
        lora_alpha=lora_alpha,
        use_rslora=use_rslora,
        base_model_name_or_path=base_model_name_or_path,
    )
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out
