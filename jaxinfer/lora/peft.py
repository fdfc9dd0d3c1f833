"""Reading a LoRA adapter in PEFT's format, checked against the base model (numpy, no JAX).

    adapter_config.json        peft_type LORA, r, lora_alpha, use_rslora, target_modules, ...
    adapter_model.safetensors  base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight [r, in]
                               ...                                         .lora_B.weight [out, r]

                           base_model.model.model.embed_tokens.lora_embedding_A [r, vocab]
                                               .lora_embedding_B [hidden, r]
                           base_model.model.lm_head.lora_A.weight [r, hidden], .lora_B.weight [vocab, r]

`read_adapter(path, config, max_rank, modules)` returns an Adapter: each targeted (layer, module)
pair's A [r, in] and B [out, r] as float32 (the embedding's A [r, vocab] and B [hidden, r], the
LM head's A [r, hidden] and B [vocab, r] under `vocab`), and the scale (lora_alpha / r, or
lora_alpha / sqrt(r) with rsLoRA). Everything that would make it compute something else than
PEFT does is refused with the file and the problem named: a rank above `max_lora_rank`, a module
this engine does not adapt (experts, a bias) or that the engine's slots do not hold (`modules`:
LoraConfig.lora_target_modules), a shape that does not match the base model (an adapter made for
another model), DoRA, per-module rank or alpha patterns, a file that is not a readable
safetensors file. Dropout is ignored, as at inference.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from checkpoints.errors import CheckpointError
from checkpoints.safetensors_io import SafetensorsFile
from jaxinfer.config.lora import LINEAR_MODULES, TARGET_MODULES
from jaxinfer.config.model import ModelConfig

CONFIG_NAME, WEIGHTS_NAME = "adapter_config.json", "adapter_model.safetensors"
# PEFT's module names (every family here uses Llama's) -> (our fused field, its part)
MODULES = {
    "q_proj": ("w_qkv", 0),
    "k_proj": ("w_qkv", 1),
    "v_proj": ("w_qkv", 2),
    "o_proj": ("wo", 0),
    "gate_proj": ("w_gate_up", 0),
    "up_proj": ("w_gate_up", 1),
    "down_proj": ("w_down", 0),
}
assert tuple(MODULES) == LINEAR_MODULES
# The embedding and the LM head (VOCAB_MODULES) are adapted outside the decoder layers (quant/lora_vocab.py)
ALL_MODULES = TARGET_MODULES
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+?)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
# PEFT saves the embedding's and LM head's (frozen) base weights beside their adapters by default
# (save_embedding_layers): copies of the base model's, of its shape, not read
_BASE_COPY = re.compile(r"(?:^|\.)(embed_tokens|lm_head)\.base_layer\.weight$")
_VOCAB_KEY = re.compile(
    r"(?:^|\.)(?:embed_tokens\.lora_embedding_([AB])(?:\.[\w-]+)?|lm_head\.lora_([AB])(?:\.[\w-]+)?\.weight)$"
)


class AdapterError(ValueError):
    """An adapter that cannot be served: the message names the adapter and the problem."""


@dataclasses.dataclass
class Adapter:
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]  # (layer, module) -> A [r, in], B [out, r]
    # embed_tokens / lm_head -> A [r, in], B [out, r] (the embedding's "in" is the vocabulary)
    vocab: dict[str, tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=dict)

    @property
    def target_modules(self) -> list[str]:
        return sorted({module for _, module in self.weights} | set(self.vocab), key=ALL_MODULES.index)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in [*self.weights.values(), *self.vocab.values()])


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each of the base model's adaptable modules, as PEFT stores them (the
    embedding's "in" is the vocabulary: a token picks a column of its A)."""
    e, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "embed_tokens": (v, e),
        "lm_head": (e, v),
        "q_proj": (e, q),
        "k_proj": (e, kv),
        "v_proj": (e, kv),
        "o_proj": (q, e),
        "gate_proj": (e, f),
        "up_proj": (e, f),
        "down_proj": (f, e),
    }


def read_config(path: Path) -> dict[str, Any]:
    file = path / CONFIG_NAME
    if not path.is_dir():
        raise AdapterError(f"LoRA adapter {str(path)!r}: not a directory")
    if not file.is_file():
        raise AdapterError(f"LoRA adapter {str(path)!r}: no {CONFIG_NAME} (a PEFT adapter directory has one)")
    try:
        spec = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"LoRA adapter {str(file)!r}: not valid JSON ({e})") from None
    if not isinstance(spec, dict):
        raise AdapterError(f"LoRA adapter {str(file)!r}: expected a JSON object")
    return spec


def _check_config(path: Path, spec: dict[str, Any], max_rank: int) -> tuple[int, float]:
    """(rank, scale) of a LoRA config PEFT would compute the same way we do; AdapterError else."""
    where = f"LoRA adapter {str(path)!r}"
    if spec.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type {spec.get('peft_type')!r} is not LORA")
    r, alpha = spec.get("r"), spec.get("lora_alpha", spec.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterError(f"{where}: r={r!r} must be a positive integer")
    if r > max_rank:
        raise AdapterError(f"{where}: rank {r} is above max_lora_rank={max_rank} (--max-lora-rank)")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"{where}: lora_alpha={alpha!r} must be a number")
    unsupported = {
        "use_dora": "DoRA",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "modules_to_save": "whole modules saved beside the adapter (modules_to_save)",
        "layers_to_transform": "layers_to_transform",
        "fan_in_fan_out": "transposed (Conv1D-style) weights (fan_in_fan_out)",
        "lora_bias": "LoRA biases (lora_bias)",
        "layer_replication": "layer_replication",
        "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
        "target_parameters": "adapters of parameters (target_parameters)",
        "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
        "use_qalora": "QA-LoRA (use_qalora)",
        "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    }
    for key, what in unsupported.items():
        if spec.get(key):
            raise AdapterError(f"{where}: {what} is not supported ({key}={spec[key]!r})")
    if spec.get("bias", "none") != "none":
        raise AdapterError(f"{where}: bias={spec['bias']!r} is not supported (only 'none')")
    scale = alpha / math.sqrt(r) if spec.get("use_rslora") else alpha / r
    return r, float(scale)


def _tensors(path: Path) -> SafetensorsFile:
    file = path / WEIGHTS_NAME
    if not file.is_file():
        found = sorted(p.name for p in path.iterdir())
        raise AdapterError(f"LoRA adapter {str(path)!r}: no {WEIGHTS_NAME} (found {found})")
    try:
        return SafetensorsFile(file)
    except CheckpointError as e:
        raise AdapterError(f"LoRA adapter: {e}") from None


def read_adapter(
    path: str | Path, config: ModelConfig, max_rank: int, modules: tuple[str, ...] = ALL_MODULES
) -> Adapter:
    """The adapter at `path` (a PEFT directory), checked against the base model `config`; a
    module outside `modules` (those the engine's slots hold) is refused by name."""
    path = Path(path).expanduser()
    rank, scale = _check_config(path, read_config(path), max_rank)
    tensors = _tensors(path)
    parts: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key in tensors.keys():
        vocab, match, copy = _VOCAB_KEY.search(key), _KEY.search(key), _BASE_COPY.search(key)
        if copy is not None:
            _check_base_copy(path, config, key, copy[1], tensors.shape(key))
            continue
        if vocab is not None:
            layer, module, part = -1, "embed_tokens" if vocab[1] else "lm_head", vocab[1] or vocab[2]
        elif match is None:
            raise AdapterError(
                f"LoRA adapter {str(path)!r}: tensor {key!r} is not a LoRA A/B weight of a decoder "
                f"layer's {', '.join(MODULES)}, the embedding or the LM head (biases are not supported)"
            )
        else:
            layer, module, part = int(match[1]), match[2], match[3]
        if layer >= 0 and module not in MODULES:
            raise AdapterError(
                f"LoRA adapter {str(path)!r}: module {module!r} ({key}) is not one of {', '.join(MODULES)}"
            )
        if config.num_experts and module in ("gate_proj", "up_proj", "down_proj"):
            raise AdapterError(
                f"LoRA adapter {str(path)!r}: {key}: adapters of a mixture of experts' MLP are not supported "
                "(attention modules only)"
            )
        if layer >= config.num_layers:
            raise AdapterError(
                f"LoRA adapter {str(path)!r}: {key} is for layer {layer}, but the model has {config.num_layers} layers"
            )
        if module not in modules:
            raise AdapterError(
                f"LoRA adapter {str(path)!r}: adapts {module} ({key}), which the engine's LoRA slots do not "
                f"hold (they hold {', '.join(modules)}; --lora-target-modules names them)"
            )
        parts.setdefault((layer, module), {})[part] = np.asarray(tensors.get(key), np.float32)
    if not parts:
        raise AdapterError(f"LoRA adapter {str(path)!r}: {WEIGHTS_NAME} holds no LoRA weights")
    adapter = Adapter(rank, scale, {})
    for (layer, module), ab in sorted(parts.items()):
        pair = _checked_pair(path, config, layer, module, ab, rank)
        if layer < 0:
            adapter.vocab[module] = pair
        else:
            adapter.weights[(layer, module)] = pair
    return adapter


def _check_base_copy(path: Path, config: ModelConfig, key: str, module: str, shape: tuple[int, ...]) -> None:
    """A base weight PEFT saved beside an adapter must have the base model's shape (another shape:
    a resized vocabulary, which the engine does not serve)."""
    expected = (config.vocab_size, config.hidden_size)
    if tuple(shape) != expected:
        raise AdapterError(
            f"LoRA adapter {str(path)!r}: {key} has shape {tuple(shape)}, not the base model's {module} "
            f"{expected} (an adapter for a resized vocabulary or another model?)"
        )


def adapted_modules(path: str | Path) -> set[str]:
    """The modules an adapter directory's tensors adapt, from the safetensors header alone (what
    the engine sizes its slots for); an unreadable adapter gives none (reading it refuses it)."""
    try:
        keys = _tensors(Path(path).expanduser()).keys()
    except (AdapterError, OSError):
        return set()
    found = set()
    for key in keys:
        vocab, match = _VOCAB_KEY.search(key), _KEY.search(key)
        if vocab is not None:
            found.add("embed_tokens" if vocab[1] else "lm_head")
        elif match is not None and match[2] in MODULES:
            found.add(match[2])
    return found


def _checked_pair(
    path: Path, config: ModelConfig, layer: int, module: str, ab: dict[str, np.ndarray], rank: int
) -> tuple[np.ndarray, np.ndarray]:
    where = f"LoRA adapter {str(path)!r}: " + (module if layer < 0 else f"layer {layer} {module}")
    if set(ab) != {"A", "B"}:
        raise AdapterError(f"{where}: has lora_{''.join(ab)} but not both lora_A and lora_B")
    a, b = ab["A"], ab["B"]
    d_in, d_out = module_shapes(config)[module]
    if a.shape != (rank, d_in) or b.shape != (d_out, rank):
        raise AdapterError(
            f"{where}: lora_A {a.shape} / lora_B {b.shape} do not match the base model "
            f"(expected {(rank, d_in)} / {(d_out, rank)}): an adapter for another model?"
        )
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise AdapterError(f"{where}: holds NaN or infinite values")
    return a, b
