"""Shared by the LoRA tests (single device and tests/sharding's scenarios): a tiny random Llama
checkpoint whose heads split three ways, random adapters over it, greedy runs of requests under
adapters through an Engine, and a model's parameters with adapters in their slots (`with_adapters`)
run with every token bound to one slot (`InSlot`), as the engine's step binds them."""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from lora_adapters import write_random_adapter
from safetensors.numpy import save_file

from jaxinfer.config import LoraConfig, ModelConfig
from jaxinfer.config.lora import LINEAR_MODULES
from jaxinfer.lora import LoRARequest
from jaxinfer.lora.peft import module_shapes
from jaxinfer.lora.stacking import layer_slot, vocab_slot
from jaxinfer.quant.lora import LoraWeight
from jaxinfer.quant.lora_bind import bind, bind_head
from jaxinfer.quant.lora_vocab import VocabLora
from jaxinfer.sampling import SamplingParams
from jaxinfer.worker.lora_state import attach

# 6 query heads over 3 KV heads: tensor=3 gives each shard one KV head and two query heads; the
# vocabulary splits over tensor=3 and 6 too.
TRIPLE = dict(hidden=48, heads=6, kv_heads=3, head_dim=16, mlp=96, vocab=768, layers=2)


def write_triple_checkpoint(path: Path, seed: int = 0) -> Path:
    """A random Llama checkpoint (HF names, float32) of TRIPLE's shape in `path`."""
    c, rng = TRIPLE, np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    q, kv, e, f = c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"], c["hidden"], c["mlp"]
    shapes = {"embed_tokens.weight": (c["vocab"], e), "norm.weight": (e,)}
    for i in range(c["layers"]):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (e,),
            p + "post_attention_layernorm.weight": (e,),
            p + "self_attn.q_proj.weight": (q, e),
            p + "self_attn.k_proj.weight": (kv, e),
            p + "self_attn.v_proj.weight": (kv, e),
            p + "self_attn.o_proj.weight": (e, q),
            p + "mlp.gate_proj.weight": (f, e),
            p + "mlp.up_proj.weight": (f, e),
            p + "mlp.down_proj.weight": (e, f),
        }
    tensors = {
        "model." + k: (np.ones(s) if k.endswith("norm.weight") else rng.normal(0, 0.1, s)).astype(np.float32)
        for k, s in shapes.items()
    }
    tensors["lm_head.weight"] = rng.normal(0, 0.1, (c["vocab"], e)).astype(np.float32)
    save_file(tensors, str(path / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": e,
        "intermediate_size": f,
        "num_attention_heads": c["heads"],
        "num_key_value_heads": c["kv_heads"],
        "head_dim": c["head_dim"],
        "num_hidden_layers": c["layers"],
        "vocab_size": c["vocab"],
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def write_triple_adapters(root: Path, model_dir: Path, n: int = 3) -> dict[str, str]:
    """`n` random adapters (ranks 8, 4, 2, ...; all seven modules, and the first the embedding and
    the LM head too) over the checkpoint in `model_dir` (write_triple_checkpoint's): {name: path}."""
    c = TRIPLE
    config = ModelConfig.from_hf_file(model_dir / "config.json")
    dims = module_shapes(config)
    out = {}
    for i in range(n):
        r = 8 >> i or 1
        path = write_random_adapter(
            root / f"a{i}",
            num_layers=c["layers"],
            dims=dims,
            target_modules=list(dims) if i == 0 else list(LINEAR_MODULES),
            r=r,
            lora_alpha=2 * r,
            use_rslora=bool(i % 2),
            seed=100 + i,
            scale=1.0,
        )
        out[f"a{i}"] = str(path)
    return out


def greedy_runs(engine, requests: list[tuple[list[int], str | None, str | None]], max_tokens: int) -> list[list[int]]:
    """(prompt, adapter name, path) per request, all queued at once; greedy outputs in order."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, (prompt, name, path) in enumerate(requests):
        lora = LoRARequest(name, 1, path or "") if name is not None else None
        engine.add_request(prompt, params, request_id=str(i), lora_request=lora)
    results: dict[str, list[int]] = collections.defaultdict(list)
    while engine.has_unfinished():
        for delta in engine.step():
            results[delta.request_id] += delta.outputs[0].token_ids
    return [results[str(i)] for i in range(len(requests))]


def with_adapters(model, adapters: dict, max_loras: int = 3, max_rank: int = 16, targets=None):
    """The model's params with `adapters` ({slot: Adapter}) written into their slots (`targets`:
    LoraConfig.lora_target_modules; the embedding's and LM head's stacks where it names them)."""
    dtype = np.dtype(model.params.embed.dtype)
    lora = LoraConfig(enable_lora=True, max_loras=max_loras, max_lora_rank=max_rank, lora_target_modules=targets)
    params = attach(model.params, model.config, lora, dtype)
    layers = []
    for i, layer in enumerate(params.layers):
        changes = {}
        for name, w in vars(layer).items():
            if isinstance(w, LoraWeight):
                a, b = w.a.copy(), w.b.copy()
                for slot, adapter in adapters.items():
                    a[..., slot - 1, :], b[slot - 1] = layer_slot(adapter, model.config, max_rank, i, dtype)[name]
                changes[name] = dataclasses.replace(w, a=jnp.asarray(a), b=jnp.asarray(b))
        layers.append(dataclasses.replace(layer, **changes))
    params = dataclasses.replace(params, layers=tuple(layers))
    if isinstance(params.embed, VocabLora):
        stacks = {}
        for module, a, b in params.embed.stacks():
            a, b = a.copy(), b.copy()
            for slot, adapter in adapters.items():
                rows = params.embed.shape[0]
                a[slot - 1], b[slot - 1] = vocab_slot(adapter, module, rows, model.config.hidden_size, max_rank, dtype)
            names = ("embed_a", "embed_b") if module == "embed_tokens" else ("head_a", "head_b")
            stacks.update({names[0]: jnp.asarray(a), names[1]: jnp.asarray(b)})
        params = dataclasses.replace(params, embed=dataclasses.replace(params.embed, **stacks))
    return params


@dataclasses.dataclass
class InSlot:
    """A family whose forward binds every token to one adapter slot (as the step does)."""

    family: object
    slot: int

    def forward(self, params, config, tokens, positions, kv, meta, **kw):
        slots = jnp.full(tokens.shape, self.slot, jnp.int32)
        return self.family.forward(bind(params, slots), config, tokens, positions, kv, meta, **kw)

    def compute_logits(self, params, hidden):
        return self.family.compute_logits(bind_head(params, jnp.full(hidden.shape[:1], self.slot, jnp.int32)), hidden)
