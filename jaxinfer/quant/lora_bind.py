"""Binding the LoRA stacks of a parameter tree to the rows a step computes.

    params = bind(params, slots)          # slots i32[T]: each batch token's adapter slot
    head = bind_head(params, row_slots)   # row_slots i32[N]: each LM head row's slot

Every LoraWeight (quant/lora.py) and the VocabLora's embedding (quant/lora_vocab.py) get the
one-hot [T, S] of the tokens' slots; the VocabLora's LM head gets the [N, S] of the rows it
scores. Slot 0 is no adapter; None leaves the tree as it is (LoRA off).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxinfer.quant.lora import LoraWeight, one_hot_slots
from jaxinfer.quant.lora_vocab import VocabLora


def is_lora(w: Any) -> bool:
    return isinstance(w, (LoraWeight, VocabLora))


def bind(params: Any, slots: jax.Array | None) -> Any:
    """The tree with every LoRA stack bound to the batch tokens' slots `slots` i32[T]."""
    if slots is None:
        return params

    def bound(w: Any) -> Any:
        if isinstance(w, LoraWeight):
            return w.bound(one_hot_slots(slots, w.num_slots, w.a.dtype))
        if isinstance(w, VocabLora) and w.embed_a is not None:
            return dataclasses.replace(w, mask=one_hot_slots(slots, w.num_slots, w.embed_a.dtype))
        return w

    return jax.tree.map(bound, params, is_leaf=is_lora)


def bind_head(params: Any, row_slots: jax.Array | None) -> Any:
    """The tree with the LM head's adapters bound to the slots `row_slots` i32[N] of the rows it scores."""
    if row_slots is None:
        return params

    def bound(w: Any) -> Any:
        if isinstance(w, VocabLora) and w.head_a is not None:
            return dataclasses.replace(w, head_mask=one_hot_slots(row_slots, w.num_slots, w.head_a.dtype))
        return w

    return jax.tree.map(bound, params, is_leaf=is_lora)
