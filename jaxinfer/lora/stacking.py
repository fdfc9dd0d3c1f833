"""An adapter's weights in the layout of the device slots (numpy, no JAX).

For each decoder layer and each linear field the slot holds A [in..., P*R] and B [R, out...]
(R = max_lora_rank, the scale folded into B; quant/lora.py). A fused field's P modules sit side
by side along A's last axis and share B's rows, each module's B in its own output columns:

    w_qkv      [E, K, G+2, D]  A [E, 3R]     B [R, K, G+2, D]   q -> columns [:, :G], k -> G, v -> G+1
    wo         [H, D, E]       A [H, D, R]   B [R, E]
    w_gate_up  [E, 2, F]       A [E, 2R]     B [R, 2, F]        gate -> [:, 0], up -> [:, 1]
    w_down     [F, E]          A [F, R]      B [R, E]

The embedding and the LM head (quant/lora_vocab.py), V the embedding's rows:

    embed_tokens   A [V, R] (a token's row: PEFT's lora_embedding_A transposed)   B [R, E]
    lm_head        A [E, R]                                                        B [R, V]

Every stack the slots hold is written (zeros where the adapter has no module), so a slot that
held another adapter keeps nothing of it.
"""

from __future__ import annotations

import numpy as np

from jaxinfer.config.lora import LINEAR_MODULES, VOCAB_MODULES, LoraConfig
from jaxinfer.config.model import ModelConfig
from jaxinfer.lora.peft import MODULES, Adapter, adapted_modules

# Our linear fields: how many modules each fuses, and the output axis their columns split along.
FIELD_PARTS = {"w_qkv": (3, 1), "wo": (1, 0), "w_gate_up": (2, 0), "w_down": (1, 0)}


def served_modules(lora: LoraConfig) -> tuple[str, ...]:
    """The modules the device slots hold: LoraConfig.lora_target_modules, by default the seven
    linear modules and embed_tokens / lm_head where an adapter named at start-up adapts them."""
    if lora.lora_target_modules is not None:
        return lora.lora_target_modules
    vocab = set().union(*(adapted_modules(m.path) for m in lora.lora_modules))
    return (*LINEAR_MODULES, *(m for m in VOCAB_MODULES if m in vocab))


def served_fields(modules: tuple[str, ...]) -> list[str]:
    """The linear fields whose stacks hold one of `modules` (a fused field: any of its parts)."""
    return [f for f in FIELD_PARTS if any(MODULES[m][0] == f for m in modules if m in MODULES)]


def vocab_slot(
    adapter: Adapter | None, module: str, rows: int, hidden: int, max_rank: int, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """A and B of the embedding's or the LM head's stacks for a slot holding `adapter` (rows: the
    embedding's, V)."""
    a = np.zeros((rows, max_rank) if module == "embed_tokens" else (hidden, max_rank), np.float32)
    b = np.zeros((max_rank, hidden) if module == "embed_tokens" else (max_rank, rows), np.float32)
    pair = None if adapter is None else adapter.vocab.get(module)
    if adapter is not None and pair is not None:
        lora_a, lora_b = pair  # A [r, in], B [out, r]
        r = lora_a.shape[0]
        a[: lora_a.shape[1], :r] = lora_a.T
        b[:r, : lora_b.shape[0]] = lora_b.T * adapter.scale
    return a.astype(dtype), b.astype(dtype)


def slot_shapes(config: ModelConfig, max_rank: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """field -> (A's shape, B's shape) of one slot of one layer, with the checkpoint's KV heads."""
    e, h, k, d, f, r = (
        config.hidden_size,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.intermediate_size,
        max_rank,
    )
    return {
        "w_qkv": ((e, 3 * r), (r, k, h // k + 2, d)),
        "wo": ((h, d, r), (r, e)),
        "w_gate_up": ((e, 2 * r), (r, 2, f)),
        "w_down": ((f, r), (r, e)),
    }


def layer_slot(
    adapter: Adapter | None, config: ModelConfig, max_rank: int, layer: int, dtype: np.dtype
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """One layer's A and B of every field for a slot holding `adapter` (None: an empty slot)."""
    shapes = slot_shapes(config, max_rank)
    out = {field: (np.zeros(a, np.float32), np.zeros(b, np.float32)) for field, (a, b) in shapes.items()}
    if adapter is not None:
        for module, (field, part) in MODULES.items():
            pair = adapter.weights.get((layer, module))
            if pair is not None:
                _place(out[field], field, part, pair[0], pair[1] * adapter.scale, config, max_rank)
    return {field: (a.astype(dtype), b.astype(dtype)) for field, (a, b) in out.items()}


def _place(
    slot: tuple[np.ndarray, np.ndarray],
    field: str,
    part: int,
    lora_a: np.ndarray,
    lora_b: np.ndarray,
    config: ModelConfig,
    max_rank: int,
) -> None:
    """Writes one module's A [r, in] and scaled B [out, r] into its field's slot arrays."""
    a, b = slot
    r = lora_a.shape[0]
    rows = slice(part * max_rank, part * max_rank + r)
    if field == "wo":  # A over the attention's [H, D] inputs
        a[..., :r] = lora_a.T.reshape(config.num_heads, config.head_dim, r)
        b[:r] = lora_b.T
        return
    a[:, rows] = lora_a.T
    if field == "w_down":
        b[:r] = lora_b.T
    elif field == "w_gate_up":
        b[:r, part] = lora_b.T
    else:  # w_qkv: q heads grouped under their KV head, then K, then V
        kv, d = config.num_kv_heads, config.head_dim
        block = lora_b.T.reshape(r, kv, -1, d)  # [r, K, G or 1, D]
        group = config.num_heads // kv
        cols = slice(0, group) if part == 0 else slice(group + part - 1, group + part)
        b[:r, :, cols] = block
