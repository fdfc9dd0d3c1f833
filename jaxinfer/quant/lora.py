"""LoraWeight: a linear weight together with the LoRA adapters of every device slot.

    y = x @ W + scale_i * (x @ A_i) @ B_i      for a token of adapter slot i (slot 0: none)

The adapters of the `max_loras` device slots are stacked: `a` [in..., S, P*R] and `b` [S, R, out...]
(S slots, R = max_lora_rank: a smaller rank is zero-padded, the scale is folded into `b`). A's slots
sit after its inputs so that x @ a is one plain matmul over every slot (with the slots first,
XLA:CPU copied each A into that order on every step: 1.4 against 1.05 ms for one SmolLM2 layer's
four fields at 8 tokens x 8 slots). A fused weight's P modules (q|k|v: 3, gate|up: 2) keep their A's
side by side along a's last axis and share b's R rows, each module's B written in its own output
columns (q's in the query-head columns of each KV head, k's and v's in the two after them; gate's
and up's in their halves), so no zero blocks are stored or read. The step binds the one-hot `mask`
[T, S] of each token's slot (quant/lora_bind.py); an unbound weight (mask None) is its base alone.
`quant.einsum` then computes, for every token,

    base product + select_p(((x @ a[s])_p masked to the token's slot s) @ b[s])   (grouped einsums)

over every slot at once: one product per part p (rows T x P, b read once), each output column
then sliced from its own module's part (slices, not a third product: 0.7-0.85x the fused
fields' share time at 64 tokens x 16 slots of the 8B shape on the CPU). No gather of weights
per token, the same shapes whichever adapters a batch mixes, so changing adapters never
recompiles. Its cost grows with S x R x (in + out) (small against the base weight for R << in);
a segmented kernel is for where a device measures it faster.

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


class WrapsWeight:
    """A weight with adapters beside it: it has its base weight's shape and dtype."""

    base: Weight

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.base.shape)

    @property
    def dtype(self) -> Any:
        return self.base.dtype


@dataclasses.dataclass(frozen=True)
class LoraWeight(WrapsWeight):
    base: Weight
    a: Any  # [in..., S, P*R] (jax.Array; numpy before placement)
    b: Any  # [S, R, out...]
    field: str  # the layer field it fills (static): names its leaves
    mask: jax.Array | None = None  # [T, S] one-hot slot of each token (bound in the step)
    parts: int = 1  # modules fused in the weight (static): 3 for q|k|v, 2 for gate|up
    part_axis: int = 0  # the output axis their columns split along (static), counted in out...

    @property
    def num_slots(self) -> int:
        return int(self.a.shape[A_SLOT_AXIS])

    def bound(self, mask: jax.Array | None) -> LoraWeight:
        return dataclasses.replace(self, mask=mask)


A_SLOT_AXIS = -2  # the slots' axis of a LoraWeight's `a` (b's is 0)


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
        (w.field, w.parts, w.part_axis),
    ),
    lambda static, children: _unflatten(static, children),
    lambda w: ((w.base, w.a, w.b, w.mask), (w.field, w.parts, w.part_axis)),
)


def _unflatten(static: tuple[str, int, int], children: Any) -> LoraWeight:
    base, a, b, mask = children
    field, parts, part_axis = static
    return LoraWeight(base, a, b, field, mask, parts, part_axis)


def one_hot_slots(slots: jax.Array, num_slots: int, dtype: Any) -> jax.Array:
    """[T, S] one-hot of each row's device slot (slot 0, no adapter: all zeros)."""
    return (slots[:, None] == jnp.arange(1, num_slots + 1, dtype=slots.dtype)[None, :]).astype(dtype)


def with_lora(spec: str, x: jax.Array, w: LoraWeight, y: jax.Array) -> jax.Array:
    """y (the base product) plus the adapters' share (einsum(spec, x, w)'s), always computed
    where a mask is bound: a step whose tokens have no adapter is compiled without the masks
    (worker/step_variants.py's `without_adapters`) rather than skipping the share by a
    conditional, which cost a tenth of the adapters' decode speed on the CPU."""
    if w.mask is None:
        return y
    return y + lora_delta(spec, x, w).astype(y.dtype)


def lora_delta(spec: str, x: jax.Array, w: LoraWeight) -> jax.Array:
    """The adapters' share of einsum(spec, x, w): `spec` names the base weight's axes as
    [in..., out...] (as quant.einsum's); x's free axes are the tokens [T] the mask rows follow.

    With fewer tokens than slots (a small decode batch) each token's own slot is gathered and
    read, T slots' A and B instead of all S: one request under an adapter reads 1/S of the
    stacks. Otherwise every slot is read once and each token's rows are masked to its own."""
    if w.mask is None:
        raise ValueError(f"LoraWeight {w.field}: no slot mask bound (quant.lora.bind)")
    operands, out = spec.split("->")
    x_letters, w_letters = operands.split(",")
    inputs = "".join(c for c in w_letters if c in x_letters and c not in out)
    outputs = w_letters[len(inputs) :]
    free = "".join(c for c in x_letters if c not in inputs)
    s, r, p = [c for c in string.ascii_letters if c not in spec][:3]
    # In the slots' dtype (LoraConfig.lora_dtype), summed in float32: narrower slots than x are read
    # as they are (converting them to x's dtype first wrote a wider copy of every stack each step).
    dtype, f32 = w.a.dtype, jnp.float32
    x = x.astype(dtype)
    if len(free) == 1 and x.shape[0] < w.num_slots:
        slot, adapted = jnp.argmax(w.mask, axis=-1), w.mask.sum(axis=-1).astype(f32)  # [T]
        a = jnp.moveaxis(jnp.take(w.a, slot, axis=w.a.ndim + A_SLOT_AXIS), -2, 0)  # [T, in..., P*R]
        xa = jnp.einsum(f"{x_letters},{free}{inputs}{r}->{free}{r}", x, a, preferred_element_type=f32)
        xa = (xa * adapted[:, None]).astype(dtype)  # [T, P*R]; 0 for a token with no adapter
        b, xa_letters, b_letters = jnp.take(w.b, slot, axis=0), free + r, free + r + outputs  # b [T, R, out...]
    else:
        xa = jnp.einsum(f"{x_letters},{inputs}{s}{r}->{free}{s}{r}", x, w.a, preferred_element_type=f32)
        xa = (xa * w.mask.astype(f32)[..., None]).astype(dtype)  # [T, S, P*R], only each token's own slot
        b, xa_letters, b_letters = w.b, free + s + r, s + r + outputs
    if w.parts == 1:
        return jnp.einsum(f"{xa_letters},{b_letters}->{out}", xa, b, preferred_element_type=f32)
    xa = xa.reshape(*xa.shape[:-1], w.parts, -1)  # [..., P, R]
    xa_letters = xa_letters[:-1] + p + r
    y = jnp.einsum(f"{xa_letters},{b_letters}->{free}{p}{outputs}", xa, b, preferred_element_type=f32)
    part, axis = len(free), len(free) + w.part_axis  # y's part axis; the fused axis, once it is gone
    pieces = [
        jax.lax.slice_in_dim(jax.lax.index_in_dim(y, i, part, keepdims=False), start, stop, axis=axis)
        for i, start, stop in part_runs(w.parts, b.shape[2 + w.part_axis])
    ]
    return jnp.einsum(f"{free}{outputs}->{out}", jnp.concatenate(pieces, axis=axis))


def part_runs(parts: int, n: int) -> list[tuple[int, int, int]]:
    """(part, start, stop): which fused module the entries [start, stop) of the n along the part
    axis belong to -- q|k|v (3 parts): a KV head's G query heads, then its K, then its V (n =
    G + 2); gate|up (2 parts): gate, then up."""
    if parts == 3 and n >= 3:
        return [(0, 0, n - 2), (1, n - 2, n - 1), (2, n - 1, n)]
    if parts == 2 and n == 2:
        return [(0, 0, 1), (1, 1, 2)]
    raise ValueError(f"no column layout for {parts} fused modules over {n} columns")


def lora_axes(
    param_axes: Mapping[str, tuple[str, ...]], inputs: Mapping[str, tuple[int, ...]]
) -> dict[str, tuple[str, ...]]:
    """Logical axes of the stacked A and B of each linear field: A [in..., slots, rank] splits
    like the weight's inputs, B [slots, rank, out...] like its outputs (sharding/rules.py)."""
    out = {}
    for field, in_axes in inputs.items():
        axes = param_axes[field]
        outs = tuple(a for i, a in enumerate(axes) if i not in in_axes)
        out[lora_name(field, "a")] = (*(axes[i] for i in in_axes), "lora_slots", "lora_rank")
        out[lora_name(field, "b")] = ("lora_slots", "lora_rank", *outs)
    return out
