"""LoraWeight: a linear weight together with the LoRA adapters of every device slot.

    y = x @ W + scale_i * (x @ A_i) @ B_i      for a token of adapter slot i (slot 0: none)

The adapters of the `max_loras` device slots are stacked: `a` [S, in..., R] and `b` [S, R, out...]
(S slots, R = max_lora_rank; a smaller rank is zero-padded, the scale is folded into `b`, and a
fused q|k|v or gate|up weight's adapters sit side by side along R, their B blocks in their own
output columns). The step binds the one-hot `mask` [T, S] of each token's slot (`bind`); an
unbound weight (mask None) is its base alone. `quant.einsum` then computes, for every token,

    base product + ((x @ a[s]) masked to the token's slot s) @ b[s]      (grouped einsums)

over every slot at once: no gather of weights per token, the same shapes whichever adapters
a batch mixes, so changing adapters never recompiles. Its cost grows with S x R (small against
the base weight for R << in); a segmented kernel is for where a device measures it faster.

Leaves: the base keeps its field's name (its arrays shard like the field); `a` and `b` sit under
"<field>.lora_a" / "<field>.lora_b", whose logical axes `lora_axes` derives from the field's.
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

# A linear weight of any form the layers' einsum takes (array, QuantizedWeight, OutFirstWeight).
Weight = Any


@dataclasses.dataclass(frozen=True)
class LoraWeight:
    base: Weight
    a: Any  # [S, in..., R] (jax.Array; numpy before placement)
    b: Any  # [S, R, out...]
    field: str  # the layer field it fills (static): names its leaves
    mask: jax.Array | None = None  # [T, S] one-hot slot of each token (bound in the step)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.base.shape)

    @property
    def dtype(self) -> Any:
        return self.base.dtype

    def bound(self, mask: jax.Array | None) -> LoraWeight:
        return dataclasses.replace(self, mask=mask)


def lora_name(field: str, part: str) -> str:
    """The leaf name of a field's stacked A ("a") or B ("b")."""
    return f"{field}.lora_{part}"


jax.tree_util.register_pytree_with_keys(
    LoraWeight,
    lambda w: (
        [
            (jax.tree_util.FlattenedIndexKey(0), w.base),
            (jax.tree_util.GetAttrKey(lora_name(w.field, "a")), w.a),
            (jax.tree_util.GetAttrKey(lora_name(w.field, "b")), w.b),
            (jax.tree_util.GetAttrKey("lora_mask"), w.mask),
        ],
        w.field,
    ),
    lambda field, children: _unflatten(field, children),
    lambda w: ((w.base, w.a, w.b, w.mask), w.field),
)


def _unflatten(field: str, children: Any) -> LoraWeight:
    base, a, b, mask = children
    return LoraWeight(base, a, b, field, mask)


def is_lora(w: Any) -> bool:
    return isinstance(w, LoraWeight)


def bind(params: Any, slots: jax.Array | None) -> Any:
    """The parameter tree with every LoraWeight bound to the tokens' adapter slots: `slots`
    i32[T] (0: no adapter, i >= 1: device slot i). None: the tree as it is."""
    if slots is None:
        return params

    def bound(w: Any) -> Any:
        if not isinstance(w, LoraWeight):
            return w
        one_hot = slots[:, None] == jnp.arange(1, w.a.shape[0] + 1, dtype=slots.dtype)[None, :]  # [T, S]
        return w.bound(one_hot.astype(w.a.dtype))

    return jax.tree.map(bound, params, is_leaf=is_lora)


def lora_delta(spec: str, x: jax.Array, w: LoraWeight) -> jax.Array:
    """The adapters' share of einsum(spec, x, w): `spec` names the base weight's axes as
    [in..., out...] (as quant.einsum's); x's free axes are the tokens [T] the mask rows follow."""
    if w.mask is None:
        raise ValueError(f"LoraWeight {w.field}: no slot mask bound (quant.lora.bind)")
    operands, out = spec.split("->")
    x_letters, w_letters = operands.split(",")
    inputs = "".join(c for c in w_letters if c in x_letters and c not in out)
    outputs = w_letters[len(inputs) :]
    free = "".join(c for c in x_letters if c not in inputs)
    s, r = [c for c in string.ascii_letters if c not in spec][:2]
    xa = jnp.einsum(f"{x_letters},{s}{inputs}{r}->{free}{s}{r}", x, w.a.astype(x.dtype))  # [T, S, R]
    xa = xa * w.mask.astype(x.dtype)[..., None]  # only each token's own slot
    return jnp.einsum(f"{free}{s}{r},{s}{r}{outputs}->{out}", xa, w.b.astype(x.dtype))


def lora_axes(
    param_axes: Mapping[str, tuple[str, ...]], inputs: Mapping[str, tuple[int, ...]]
) -> dict[str, tuple[str, ...]]:
    """Logical axes of the stacked A and B of each linear field: A [slots, in..., rank] splits
    like the weight's inputs, B [slots, rank, out...] like its outputs (sharding/rules.py)."""
    out = {}
    for field, in_axes in inputs.items():
        axes = param_axes[field]
        outs = tuple(a for i, a in enumerate(axes) if i not in in_axes)
        out[lora_name(field, "a")] = ("lora_slots", *(axes[i] for i in in_axes), "lora_rank")
        out[lora_name(field, "b")] = ("lora_slots", "lora_rank", *outs)
    return out
