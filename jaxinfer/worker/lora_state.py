"""LoRA adapters on the device: the slot stacks each targeted linear carries, and writing a slot.

    params = attach(params, config, lora, dtype)   # every layer's w_qkv, wo, w_gate_up, w_down
                                                   # -> LoraWeight(base, a, b): empty slots;
                                                   # the embedding -> VocabLora (embedding, LM head)
    writer = SlotWriter(state)                     # after placement (shardings known)
    writer.write(slot, adapter)                    # host arrays (lora/stacking.py) -> slot `slot`

The stacks are part of the parameter tree, so they are placed like it: `lora_axes` gives A the
logical axes of the weight's inputs and B those of its outputs (a fused q|k|v's B splits by KV
head, with KV heads repeated as the layout asks, like the weight). A write replaces one slot of
every stack in one jitted call that donates the old stacks: its shapes never change, so it
compiles once, at start-up, and never after (the step's variants do not depend on what the
slots hold). The compiled step submits writes on its launcher, in order with the steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.config import LoraConfig, ModelConfig
from jaxinfer.lora.peft import Adapter
from jaxinfer.lora.stacking import FIELD_PARTS, layer_slot, served_fields, served_modules, slot_shapes, vocab_slot
from jaxinfer.models.linear_layout import LAYER_LINEARS
from jaxinfer.quant.lora import A_SLOT_AXIS, LoraWeight, lora_axes, lora_name
from jaxinfer.quant.lora_bind import is_lora
from jaxinfer.quant.lora_vocab import VocabLora, vocab_axes
from sharding import repeat_kv_heads

Params = Any  # a family's parameter tree


def lora_param_axes(param_axes: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """The family's logical axes with those of the LoRA stacks added."""
    return {**param_axes, **lora_axes(param_axes, {f: LAYER_LINEARS[f] for f in FIELD_PARTS}), **vocab_axes()}


def attach(params: Params, config: ModelConfig, lora: LoraConfig, dtype: Any) -> Params:
    """Every linear of every layer the slots hold (lora/stacking.py's served_modules) wrapped in a
    LoraWeight with empty (zero) slots, and the embedding in a VocabLora where they hold the
    embedding or the LM head, as host arrays: the caller places the tree."""
    modules = served_modules(lora)
    shapes = slot_shapes(config, lora.max_lora_rank)
    s = lora.max_loras

    def wrap(layer: Any) -> Any:
        changes = {
            field: LoraWeight(
                getattr(layer, field),
                np.zeros((*shapes[field][0][:-1], s, shapes[field][0][-1]), dtype),
                np.zeros((s, *shapes[field][1]), dtype),
                field,
                parts=FIELD_PARTS[field][0],
                part_axis=FIELD_PARTS[field][1],
            )
            for field in served_fields(modules)
            if getattr(layer, field, None) is not None
        }
        return dataclasses.replace(layer, **changes)

    params = dataclasses.replace(params, layers=tuple(wrap(layer) for layer in params.layers))
    vocab: dict[str, Any] = {}
    for module, names in (("embed_tokens", ("embed_a", "embed_b")), ("lm_head", ("head_a", "head_b"))):
        if module in modules:
            a, b = vocab_slot(None, module, params.embed.shape[0], config.hidden_size, lora.max_lora_rank, dtype)
            vocab.update({names[0]: np.zeros((s, *a.shape), dtype), names[1]: np.zeros((s, *b.shape), dtype)})
    return dataclasses.replace(params, embed=VocabLora(params.embed, **vocab)) if vocab else params


def detach(params: Params) -> Params:
    """The tree without its LoRA stacks: each LoraWeight's (and VocabLora's) base weight in its place."""
    return jax.tree.map(lambda w: w.base if is_lora(w) else w, params, is_leaf=is_lora)


def _stacks(params: Params) -> list[tuple[tuple[Any, ...], Any, Any]]:
    """(site, A, B) of every pair of stacks: site ("layer", i, field) or ("vocab", module). A
    layer's A holds its slots on axis A_SLOT_AXIS, the others on their first axis."""
    sites: list[tuple[tuple[Any, ...], Any, Any]] = [
        (("layer", i, w.field), w.a, w.b)
        for i, layer in enumerate(params.layers)
        for w in vars(layer).values()
        if isinstance(w, LoraWeight)
    ]
    if isinstance(params.embed, VocabLora):
        sites += [(("vocab", module), a, b) for module, a, b in params.embed.stacks()]
    return sites


class SlotWriter:
    """Writes adapters into the device slots of a DeviceState's parameter tree."""

    def __init__(self, state: Any, config: ModelConfig, lora: LoraConfig, kv_repeat: int) -> None:
        self.state, self.config, self.lora, self.kv_repeat = state, config, lora, kv_repeat
        stacks = _stacks(state.params)
        self._sites = [site for site, _, _ in stacks]
        self._axes = lora_param_axes(dict(state.family.param_axes))
        self._dtype = stacks[0][1].dtype
        shardings = [(a.sharding, b.sharding) for _, a, b in stacks]
        self._axes_of = tuple((a.ndim + A_SLOT_AXIS if site[0] == "layer" else 0, 0) for site, a, _ in stacks)
        self._write = jax.jit(_write_slot, donate_argnums=0, static_argnums=3, out_shardings=shardings)
        self._slice = [(_one_slot(a, i), _one_slot(b, j)) for (a, b), (i, j) in zip(shardings, self._axes_of)]
        self.write(1, None)  # compiled now, never after

    def num_compiled(self) -> int:
        return self._write._cache_size()  # type: ignore[attr-defined]  # jit's count; not in jax's stubs

    def write(self, slot: int, adapter: Adapter | None) -> None:
        """Slot `slot` (1..max_loras) holds `adapter` (None: empty) from the next step on."""
        if not 1 <= slot <= self.lora.max_loras:
            raise ValueError(f"LoRA slot {slot} is not in 1..{self.lora.max_loras}")
        rank, config = self.lora.max_lora_rank, self.config
        layers = [layer_slot(adapter, config, rank, i, self._dtype) for i in range(config.num_layers)]
        rows = self.state.params.embed.shape[0]
        new = []
        for site, (a_at, b_at) in zip(self._sites, self._slice):
            if site[0] == "vocab":
                a, b = vocab_slot(adapter, site[1], rows, config.hidden_size, rank, self._dtype)
            else:
                a, b = layers[site[1]][site[2]]
                b = repeat_kv_heads(b, self._axes[lora_name(site[2], "b")][1:], self.kv_repeat)
            new.append((jax.device_put(a, a_at), jax.device_put(b, b_at)))
        params = self.state.params
        stacks = [(a, b) for _, a, b in _stacks(params)]
        written = self._write(stacks, jnp.int32(slot - 1), new, self._axes_of)
        self.state.params = _replaced(params, written)


def _write_slot(
    stacks: list[tuple[jax.Array, jax.Array]], index: jax.Array, new: list, axes: tuple[tuple[int, int], ...]
) -> list:
    """Each stack with slot `index` (on its slots' axis, `axes`) replaced by its new arrays."""
    return [
        (_at_slot(a, index, i, na), _at_slot(b, index, j, nb)) for (a, b), (na, nb), (i, j) in zip(stacks, new, axes)
    ]


def _at_slot(stack: jax.Array, index: jax.Array, axis: int, value: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(stack, value.astype(stack.dtype), index, axis)


def _one_slot(sharding: Any, axis: int) -> Any:
    """The sharding of one slot of a stack placed with `sharding` (its slots' axis `axis` dropped)."""
    if isinstance(sharding, NamedSharding):
        spec = list(sharding.spec) + [None] * (axis + 1 - len(sharding.spec))
        return NamedSharding(sharding.mesh, P(*spec[:axis], *spec[axis + 1 :]))
    if isinstance(sharding, SingleDeviceSharding):
        return sharding
    raise ValueError(f"LoRA stacks placed with an unexpected sharding {sharding}")


def _replaced(params: Params, written: list[tuple[jax.Array, jax.Array]]) -> Params:
    pairs = iter(written)

    def layer_with(layer: Any) -> Any:
        changes = {}
        for name, w in vars(layer).items():
            if isinstance(w, LoraWeight):
                a, b = next(pairs)
                changes[name] = dataclasses.replace(w, a=a, b=b)
        return dataclasses.replace(layer, **changes) if changes else layer

    params = dataclasses.replace(params, layers=tuple(layer_with(layer) for layer in params.layers))
    embed = params.embed
    if not isinstance(embed, VocabLora):
        return params
    names = {"embed_tokens": ("embed_a", "embed_b"), "lm_head": ("head_a", "head_b")}
    changes = {}
    for module, _, _ in embed.stacks():
        a, b = next(pairs)
        changes.update(dict(zip(names[module], (a, b))))
    return dataclasses.replace(params, embed=dataclasses.replace(embed, **changes))
