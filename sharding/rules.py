"""Logical axis names -> mesh axes: the one rule table, and partition specs derived from it.

Models name the axes of every parameter (e.g. Llama's PARAM_AXES: wq is ("embed", "heads",
"head_dim")); nothing here is written per tensor. A parameter's PartitionSpec maps each of its
logical axes through LOGICAL_RULES. Tensor parallelism falls out of the table: q/k/v projections
are split by (kv) heads and the output projection by its input heads, gate/up by MLP columns and
down by MLP rows, so each shard computes whole heads and whole MLP columns and XLA adds exactly
one all-reduce after attention and one after the MLP; the embedding and LM head are split by
vocabulary rows.

Fewer KV heads than tensor shards (K < tp): every shard needs the KV head its query heads read,
so each KV head is stored r = tp / K times (wk, wv, their biases and the KV cache all carry
K' = K * r = tp heads) and each shard holds exactly one. The alternative, a replicated cache that
each shard slices, costs every device the whole cache (K heads) instead of one head; see
README.md "Sharding and multi-host".

Fused q|k|v weights ([E, K, G+2, D] on axes embed, kv_heads, qkv, head_dim) split like wk: by KV
head, each shard holding whole groups. With replicated KV heads a group's G query heads are dealt
out among its r copies (G/r each) while K and V are repeated (placement.repeat_kv_heads).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sharding.mesh import DATA, EXPERT, SEQUENCE, STAGE, TENSOR, AnyMesh, axis_size

logger = logging.getLogger(__name__)

# A pytree (dataclasses, dicts, lists) of arrays; JAX has no static type for one.
PyTree = Any
# Each parameter field's logical axis names, e.g. {"wq": ("embed", "heads", "head_dim")}.
ParamAxes = Mapping[str, tuple[str, ...]]

# The rule table. None: never split (every shard holds the whole axis).
LOGICAL_RULES: dict[str, str | None] = {
    "batch": DATA,
    "seq": SEQUENCE,
    "heads": TENSOR,
    "kv_heads": TENSOR,
    "mlp": TENSOR,
    "vocab": TENSOR,
    "embed": None,
    "head_dim": None,
    "qkv": None,  # a KV head's group: its query heads, then K and V (fused projections)
    "gate_up": None,  # gate | up of a fused MLP projection
    "experts": EXPERT,  # a mixture's stacked experts (sharding/experts.py computes each shard's own)
    "lora_slots": None,  # the LoRA adapters' device slots (jaxinfer/quant/lora.py)
    "lora_rank": None,  # ... and their rank: A splits like its weight's inputs, B like its outputs
}
# Axes a model may leave unsplit when its size does not divide the mesh axis (with a warning);
# any other indivisible axis is a configuration error.
_MAY_REPLICATE = ("vocab",)
# Logical axes also split over an outer mesh axis where the mesh has one and the size divides:
# the vocabulary over pipeline stages (sharding/stages.py), so the embedding and LM head, which
# run outside the stages, cost each device its share of the mesh instead of a stage's share.
_ALSO_OVER = {"vocab": STAGE}


def logical_to_spec(axes: tuple[str, ...], shape: tuple[int, ...], mesh: AnyMesh | None, strict: bool = True) -> P:
    """PartitionSpec of an array whose dimensions have these logical names. `strict=False` keeps
    any axis whose size does not divide its mesh axis whole, silently: the sharding a checkpoint's
    array is read under before `finish` gives it its final placement (e.g. unrepeated KV heads)."""
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match shape {shape}")
    out: list[str | None] = []
    used: set[str] = set()
    for name, dim in zip(axes, shape):
        if name not in LOGICAL_RULES:
            raise ValueError(f"unknown logical axis {name!r}; known: {sorted(LOGICAL_RULES)}")
        mesh_axis = LOGICAL_RULES[name]
        size = axis_size(mesh, mesh_axis) if mesh_axis else 1
        # size 1: e.g. a per-channel scale's input axis
        if mesh_axis is None or size == 1 or mesh_axis in used or dim == 1:
            out.append(None)
            continue
        if dim % size:
            if not strict:
                out.append(None)
                continue
            if name not in _MAY_REPLICATE:
                raise ValueError(
                    f"logical axis {name!r} of size {dim} cannot be split over mesh axis {mesh_axis!r} of size {size}"
                )
            logger.warning("%s=%d does not divide by %s=%d: kept whole on every device", name, dim, mesh_axis, size)
            out.append(None)
            continue
        out.append(mesh_axis)
        used.add(mesh_axis)
    return _also_over(axes, shape, mesh, out)


def _also_over(axes: tuple[str, ...], shape: tuple[int, ...], mesh: AnyMesh | None, out: list) -> P:
    """`out` with each axis of _ALSO_OVER split over its outer mesh axis too, outside the split
    it has, where the sizes divide (else as it was)."""
    for i, (name, dim) in enumerate(zip(axes, shape)):
        outer = _ALSO_OVER.get(name)
        if outer is None or axis_size(mesh, outer) == 1 or outer in out:
            continue
        inner = () if out[i] is None else (out[i],)
        if dim % (axis_size(mesh, outer) * (axis_size(mesh, out[i]) if inner else 1)) == 0:
            out[i] = (outer, *inner) if inner else outer
    return P(*out)


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """How attention heads split over the tensor axis (see the module docstring)."""

    num_heads: int
    num_kv_heads: int
    tensor: int

    def __post_init__(self) -> None:
        h, k, tp = self.num_heads, self.num_kv_heads, self.tensor
        if h % tp:
            raise ValueError(f"tensor={tp} must divide the {h} attention heads")
        if k % tp and tp % k:
            raise ValueError(
                f"tensor={tp} and the {k} KV heads must divide one another "
                f"(each shard's query heads must share whole KV heads)"
            )

    @property
    def kv_repeat(self) -> int:
        """Copies of each KV head: 1 when K >= tp, else tp / K."""
        return max(1, self.tensor // self.num_kv_heads)

    @property
    def cache_kv_heads(self) -> int:
        """KV heads the projections and the cache carry (K, or tp when K < tp)."""
        return self.num_kv_heads * self.kv_repeat

    @property
    def kv_heads_per_device(self) -> int:
        return self.cache_kv_heads // self.tensor


def head_layout(mesh: AnyMesh | None, num_heads: int, num_kv_heads: int) -> HeadLayout:
    return HeadLayout(num_heads, num_kv_heads, axis_size(mesh, TENSOR))


def leaf_name(path: jax.tree_util.KeyPath) -> str:
    """The field name a leaf sits under (its last attribute or key in the tree)."""
    for entry in reversed(path):
        name = getattr(entry, "name", None) or getattr(entry, "key", None)
        if isinstance(name, str):
            return name
    raise ValueError(f"parameter at {jax.tree_util.keystr(path)} has no field name")


def param_specs(params: PyTree, param_axes: ParamAxes, mesh: AnyMesh | None) -> PyTree:
    """PartitionSpec of every parameter, from the model's logical axes (a tree like params)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: logical_to_spec(param_axes[leaf_name(path)], x.shape, mesh), params
    )


def param_shardings(params: PyTree, param_axes: ParamAxes, mesh: Mesh) -> PyTree:
    """A NamedSharding for every parameter (a tree like params), from `param_specs`."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs(params, param_axes, mesh))


def kv_cache_spec(mesh: AnyMesh | None, *, replicas: bool) -> P:
    """A layer's cache [P, page, 2K', D] (with a leading [data] axis for replicas): split by KV
    heads over tensor; K and V of a head are neighbours on axis 2, so they stay together. With
    `sequence` > 1 each page's rows split over it too: each shard holds its rows of every page
    (pallas_kernels/split_rows.py)."""
    heads = TENSOR if axis_size(mesh, TENSOR) > 1 else None
    rows = SEQUENCE if axis_size(mesh, SEQUENCE) > 1 else None
    return P(*((DATA,) if replicas else ()), None, rows, heads, None)


def unsplit_rows(spec: P) -> P:
    """A cache's spec with its page-row axis (third from last) whole over `sequence`: the per-head
    scales of an int8 / fp8 cache ([.., 1, S, 2K, 1]) split like its pages but for their rows,
    one per pipeline stage (still split over `stage`)."""
    parts = list(spec) + [None] * max(0, 4 - len(spec))
    rows = parts[-3]
    kept = tuple(a for a in ((rows,) if isinstance(rows, str) else rows or ()) if a != SEQUENCE)
    parts[-3] = None if not kept else kept[0] if len(kept) == 1 else kept
    return P(*parts)


def tokens_spec(mesh: AnyMesh | None, *, replicas: bool) -> P:
    """Token-axis step inputs (ids, positions): split along the sequence axis."""
    seq = SEQUENCE if axis_size(mesh, SEQUENCE) > 1 else None
    return P(*((DATA,) if replicas else ()), seq)


def replicated_spec(*, replicas: bool) -> P:
    return P(DATA) if replicas else P()
