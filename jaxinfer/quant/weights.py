"""Quantized linear weights: the pytree and the in-jit einsum (host-side quantizers: quantize.py).

    int8: integers q (int8), one scale per output channel (group 0) or per group of `group`
          consecutive inputs: w ~ q * s; our int8 method uses q in [-127, 127].
    int4: q in [0, 15], two per byte (uint8), the even input index in the low nibble, one scale
          per group of `group` consecutive inputs (along the weight's last input axis).
    fp8:  float8 e4m3 values, one scale per output channel or per group: w ~ v * s.
    Either may carry integer zero points, w ~ (q - z) * s (GGUF Q4_0's constant 8; int4 checkpoints
    saved before offsets), or float offsets added after scaling, w ~ q * s + o (our int4: o is the
    group's minimum; GGUF Q4_1 / Q5_1 mins, the K-quants' -dmin * m); GGUF's blocks are repacked
    into these layouts by quant/gguf.py, compressed-tensors checkpoints by quant/compressed.py.
`activations` ("int8" / "fp8", per token or per tensor): the weight's inputs are quantized on the
fly too (W8A8, FP8_DYNAMIC), as quant/activations.py does before the matmul.

Weights keep our layout [in axes..., out axes...] and `inputs` says which axes are inputs (the
contracted ones). Scales, zero points and offsets keep the weight's rank: size 1 on the axes they
do not vary over (per-channel int8: every input axis), the group count on the grouped axis. So
they share their weight's logical axis names and split over a mesh like it, and fusing q|k|v or
gate|up along output axes is the same concatenation on every array (quant/fuse.py).

A QuantizedWeight's arrays sit in the tree under index keys, not names: a sharding rule, which
looks up the nearest name on a leaf's path, finds the field the weight fills (e.g. "w_qkv").
`dtype` is the float dtype the weight stands for (the model's): dequantizing computes in the
wider of it and the scales' dtype (GGUF scales are float16 / float32), then casts to it.

`einsum` is the one matmul every linear layer calls. Plain arrays go to jnp.einsum (one 2-D dot
where several leading weight axes are contracted: `_merged_contraction`); out-first weights (the
CPU step's layout, out_first.py) and weights contracted on their trailing axes (the tied LM
head) to `out_first.contract_rows`;
out-first per-channel int8 / fp8 and grouped int4 / int8 (the CPU's, out_first_int8.py,
out_first_grouped.py) their own forms, a grouped weight stored output-first (a tied quantized LM
head) the latter's reduction in place;
per-channel int8 / fp8 runs the dot on the values converted to the activation dtype and scales
its output columns; every other layout is dequantized first (its scales vary along the contraction).
Inside the jitted step XLA fuses the conversion into the dot's operand on GPU/TPU; the weights
stay quantized in memory. `embedding_rows` gathers rows of a (quantized) embedding, then
dequantizes only those.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jaxinfer.quant import act_order, activations, out_first_grouped, out_first_int8
from jaxinfer.quant.lora import LoraWeight, with_lora
from jaxinfer.quant.nibbles import unpack_int4
from jaxinfer.quant.out_first import OutFirstWeight, contract_rows

# A quantized weight's arrays: numpy as the host quantizes them, jax.Array once placed; as a pytree
# its leaves are also whatever a tree map puts there (shardings, shape structs), so left open.
Component = Any


class QuantizedWeight:
    """values (int8, uint8 holding two int4, or float8), scales, optional zeros / offsets + static
    layout (and the quantization its inputs get, if any)."""

    def __init__(
        self,
        values: Component,
        scales: Component,
        zeros: Component | None,
        method: str,
        inputs: tuple[int, ...],
        group: int = 0,
        offsets: Component | None = None,
        dtype: DTypeLike | None = None,
        activations: tuple[str, str] | None = None,
        perm: Component | None = None,
    ):
        self.values, self.scales, self.zeros, self.offsets = values, scales, zeros, offsets
        self.perm = perm  # act-order: the original input of each stored input row (act_order.py)
        self.method, self.inputs, self.group = method, tuple(inputs), group
        self.dtype = np.dtype(scales.dtype if dtype is None else dtype)
        # (kind, "token" | "tensor") of the inputs' quantization, if any
        self.activations: tuple[str, str] | None = None if activations is None else (activations[0], activations[1])

    @property
    def axis(self) -> int:
        """The grouped (and, for int4, packed) input axis."""
        return self.inputs[-1]

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the float weight it stands for."""
        shape = list(self.values.shape)
        if self.method == "int4":
            shape[self.axis] *= 2
        return tuple(shape)

    @property
    def per_channel_int8(self) -> bool:
        """int8 (or fp8) with one scale per output channel and nothing else: a matmul can run on
        the values and scale its output columns."""
        return self.method in ("int8", "fp8") and not self.group and self.zeros is None and self.offsets is None

    def layout(self) -> str:
        """E.g. "int4 g32 +offsets", "int8 per-channel": how the weight is stored."""
        extras = {"zeros": self.zeros, "offsets": self.offsets, "act-order": self.perm}
        return layout_name(self.method, self.group, [k for k, v in extras.items() if v is not None], self.activations)

    def arrays(self) -> dict[str, jax.Array | np.ndarray]:
        """Its arrays by component name (how a checkpoint stores them)."""
        named = {"values": self.values, "scales": self.scales, "zeros": self.zeros, "offsets": self.offsets}
        named["perm"] = self.perm
        return {name: array for name, array in named.items() if array is not None}

    def devices(self) -> set[jax.Device]:
        return self.values.devices()

    def __getitem__(self, rows: jax.Array) -> jax.Array:
        """`embed[tokens]` of a quantized embedding [V, E]: the rows gathered, then dequantized."""
        if 0 in self.inputs:
            raise TypeError(f"{self!r}: rows of a weight are gathered only along a non-input first axis")
        return dequantize(self.map(lambda a: a[rows]))

    def map(self, fn: Callable[[Component], Component]) -> QuantizedWeight:
        """fn applied to each array (e.g. placing each on its devices)."""
        maybe = lambda a: None if a is None else fn(a)  # noqa: E731
        return QuantizedWeight(
            fn(self.values),
            fn(self.scales),
            maybe(self.zeros),
            self.method,
            self.inputs,
            self.group,
            maybe(self.offsets),
            self.dtype,
            self.activations,
            maybe(self.perm),
        )

    def with_perm(self, perm: Component | None) -> QuantizedWeight:
        """The same weight with `perm` (flat, or any shape of its size) as its act-order."""
        w = self.map(lambda a: a)
        w.perm = None if perm is None else act_order.shaped(perm, self.shape, self.inputs)
        return w

    def __repr__(self) -> str:
        return f"QuantizedWeight({self.layout()}, shape={self.shape}, inputs={self.inputs}, dtype={self.dtype})"


def layout_name(method: str, group: int, extras: Iterable[str] = (), activations: tuple[str, str] | None = None) -> str:
    """E.g. "int4 g32 +offsets", "int8 per-channel +int8 activations per token"."""
    parts = [method, f"g{group}" if group else "per-channel", *(f"+{extra}" for extra in extras)]
    return " ".join(parts + ([] if activations is None else ["+{} activations per {}".format(*activations)]))


def _flatten_with_keys(
    w: QuantizedWeight,
) -> tuple[list[tuple[jax.tree_util.FlattenedIndexKey, Component]], tuple[Any, ...]]:
    children = (w.values, w.scales, w.zeros, w.offsets, w.perm)
    keys = [jax.tree_util.FlattenedIndexKey(i) for i in range(5)]
    return list(zip(keys, children)), _aux(w)


def _aux(w: QuantizedWeight) -> tuple[Any, ...]:
    return w.method, w.inputs, w.group, w.dtype, w.activations


def _unflatten(aux: tuple[Any, ...], children: Iterable[Component]) -> QuantizedWeight:
    values, scales, zeros, offsets, perm = children
    method, inputs, group, dtype, activations = aux
    return QuantizedWeight(values, scales, zeros, method, inputs, group, offsets, dtype, activations, perm)


jax.tree_util.register_pytree_with_keys(
    QuantizedWeight,
    _flatten_with_keys,
    _unflatten,
    lambda w: ((w.values, w.scales, w.zeros, w.offsets, w.perm), _aux(w)),
)


def integers(w: QuantizedWeight) -> jax.Array:
    """The weight's integers q, one per weight (int4 unpacked)."""
    return unpack_int4(w.values, w.axis) if w.method == "int4" else w.values


def per_weight(w: QuantizedWeight, array: jax.Array) -> jax.Array:
    """A scale-shaped array [.., n/group, ..] repeated over each group: [.., n, ..] (per-channel
    arrays, of size 1 on the inputs, pass as they are and broadcast). A group longer than the
    grouped axis (n) spans group / n rows of the input axis before it: the array [.., m/span, 1, ..]
    is repeated along that axis and broadcast along the grouped one."""
    if not w.group:
        return array
    n = w.shape[w.axis]
    if w.group > n:
        return jnp.repeat(array, w.group // n, axis=w.inputs[-2])
    return jnp.repeat(array, w.group, axis=w.axis)


def dequantize(w: QuantizedWeight | jax.Array, dtype: DTypeLike | None = None) -> jax.Array:
    """The float weight a QuantizedWeight stands for, in `dtype` (default: its own); plain arrays
    pass through. Computed in the wider of `dtype` and the scales' dtype."""
    if not isinstance(w, QuantizedWeight):
        return w
    out = _stored_rows(w, w.dtype if dtype is None else dtype)
    return out if w.perm is None else act_order.unpermuted(out, w.perm, w.inputs)


def _stored_rows(w: QuantizedWeight, dtype: DTypeLike) -> jax.Array:
    """The float weight in its stored order (act-order: input rows sorted by group)."""
    compute = jnp.promote_types(w.scales.dtype, dtype)
    q = integers(w).astype(compute)
    if w.zeros is not None:
        q = q - per_weight(w, w.zeros.astype(compute))
    out = q * per_weight(w, w.scales.astype(compute))
    if w.offsets is not None:
        out = out + per_weight(w, w.offsets.astype(compute))
    return out.astype(dtype)


def embedding_rows(embed: QuantizedWeight | jax.Array, tokens: jax.Array) -> jax.Array:
    """embed [V, E] (rows are not an input axis), tokens i32[T] -> rows [T, E] in the model dtype;
    a quantized embedding gathers its integers and scales first and dequantizes only those rows."""
    return embed[tokens]  # QuantizedWeight.__getitem__ gathers, then dequantizes


def einsum(spec: str, x: jax.Array, w: QuantizedWeight | OutFirstWeight | LoraWeight | jax.Array) -> jax.Array:
    """jnp.einsum(spec, x, w) for a float, out-first or quantized weight `w` (the linear layers'
    matmul), or one of these with LoRA adapters (quant/lora.py); `spec` names the weight's axes
    as [in..., out...] in every case."""
    if isinstance(w, LoraWeight):
        y = einsum(spec, x, w.base)
        return y if w.mask is None else with_lora(spec, x, w, y)
    if isinstance(w, out_first_int8.OutFirstInt8):
        return out_first_int8.einsum(spec, x, w)
    if isinstance(w, out_first_grouped.OutFirstGrouped):
        return out_first_grouped.einsum(spec, x, w)
    if isinstance(w, OutFirstWeight):
        operands, out = spec.split("->")
        x_letters, w_letters = operands.split(",")
        return _merged_contraction(f"{x_letters},{w.spec_letters(w_letters)}->{out}", x, w.t)
    if not isinstance(w, QuantizedWeight):
        return _merged_contraction(spec, x, w)
    if w.activations is not None:  # W8A8 / FP8 with dynamic activations
        if activations.uses_quantized_matmul(w):
            return activations.quantized_matmul(spec, x, w)
        x = activations.fake_quantized(spec, x, w.activations)
    if w.perm is not None:  # act-order: the inputs read in the stored rows' order
        return jnp.einsum(spec, act_order.permuted_inputs(spec, x, w.perm, w.inputs), _stored_rows(w, x.dtype))
    if out_first_grouped.reads_in_place(w, x):  # e.g. a tied LM head's int8 blocks on the CPU
        # the barrier keeps the (free) reshape to out-first outside the fused reduction
        held = jax.lax.optimization_barrier(out_first_grouped.OutFirstGrouped.of(w))
        return out_first_grouped.einsum(spec, x, held)
    if not w.per_channel_int8:
        return jnp.einsum(spec, x, dequantize(w, x.dtype))
    operands, out = spec.split("->")
    w_letters = operands.split(",")[1]
    y = jnp.einsum(spec, x, w.values.astype(x.dtype))
    w_out = "".join(c for i, c in enumerate(w_letters) if i not in w.inputs)
    scales = jnp.squeeze(w.scales, w.inputs).astype(y.dtype)  # [out axes]
    return jnp.einsum(f"{out},{w_out}->{out}", y, scales)


def _merged_contraction(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """jnp.einsum(spec, x, w), as one 2-D product over merged axes where x's contracted axes end
    it and the output is x's other axes then w's:
    - contracted axes that start w (the output projection "thd,hde->te"): one 2-D dot. Given
      the 3-D form, XLA:CPU matched the weight to the attention output's layout by transposing
      the whole [H, D, E] weight on every step; merged, the weight is a free reshape.
    - contracted axes that end w (out-first: the tied LM head "ne,ve->nv", an OutFirstWeight):
      out_first.contract_rows."""
    operands, out = spec.split("->")
    x_letters, w_letters = operands.split(",")
    contracted = "".join(c for c in x_letters if c in w_letters and c not in out)
    n = len(contracted)
    free = x_letters[: len(x_letters) - n]
    if not x_letters.endswith(contracted):
        return jnp.einsum(spec, x, w)
    k = math.prod(x.shape[len(free) :])
    if n and w_letters.endswith(contracted) and out == free + w_letters[:-n]:
        y = contract_rows(x.reshape(-1, k), w.reshape(-1, k))
        return y.reshape(*x.shape[: len(free)], *w.shape[:-n])
    if n < 2 or not (w_letters.startswith(contracted) and out == free + w_letters[n:]):
        return jnp.einsum(spec, x, w)
    y = jnp.dot(x.reshape(-1, k), w.reshape(k, -1))
    return y.reshape(*x.shape[: len(free)], *w.shape[n:])
