"""Pipeline stages: a model's layers split into contiguous runs over the mesh's `stage` axis.

One SPMD program still runs the whole step over the whole mesh (so multi-host runs, the compiled
step, decode windows, speculation and the executable store are unchanged); what the stage axis
changes is where each layer's arrays live and which devices compute them:

    plan       layers dealt into S contiguous runs as even as they go (every slot stacks layers
               of one structure, so equal counts are equal bytes), the longer runs first:
               30 layers over 4 stages -> 8, 8, 7, 7 (StagePlan)
    slots      slot j of stage s is layer start(s) + j; a stage with fewer layers than the
               longest has padding slots of zero weights, which make a pre-norm residual layer
               the identity (each of its branches ends in a zero projection)
    weights    each leaf of slot j is the stages' j-th layers' arrays concatenated along axis 0,
               split over `stage` outside the axis's own mesh axes: a device's shard of the
               stacked array is exactly its shard of its own stage's layer, so stacking moves no
               data and no device ever holds another stage's layers (`stack_layers`)
    caches     [P, S*page, 2K, D]: the page-row axis split over `stage`, so each stage's devices
               hold its layers' rows of every page; page ids mean the same on every stage, and
               the KV manager, page copies and the host tier index pages as before
    forward    `run_stages`: a shard_map over `stage` alone (tensor, expert and data stay
               automatic inside it); at tick t stage t runs its layers (a lax.cond on the stage
               index, so the others skip them without copying their caches), then hands the
               activation [T, E] to stage t + 1 by collective permute; the last stage's result
               is broadcast (one psum) to every device for the final norm, the LM head and the
               sampler, which run over the whole mesh as before.

The embedding and LM head are not stage-local: in one SPMD program an array is either split over
an axis or repeated along it, so they stay split over `tensor` by vocabulary rows and repeated
over `stage`, as the final norm is.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sharding.mesh import AXES, DATA, STAGE, AnyMesh, axis_size, current_mesh

PyTree = Any


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """How `sum(counts)` layers split into contiguous stages: stage s runs `counts[s]` layers
    from `starts[s]`, in slots 0 .. counts[s] - 1 of the `num_slots` every stage has."""

    counts: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.counts)

    @property
    def num_layers(self) -> int:
        return sum(self.counts)

    @property
    def num_slots(self) -> int:
        return max(self.counts)

    @functools.cached_property
    def starts(self) -> tuple[int, ...]:
        return tuple(int(x) for x in np.cumsum((0,) + self.counts[:-1]))

    def layer(self, stage: int, slot: int) -> int | None:
        """The layer in `slot` of `stage`, or None for a padding slot."""
        return self.starts[stage] + slot if slot < self.counts[stage] else None

    def stage_of(self, layer: int) -> int:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range for {self.num_layers} layers")
        return max(s for s in range(self.num_stages) if self.starts[s] <= layer)


def plan_stages(num_layers: int, num_stages: int) -> StagePlan:
    """Contiguous stages of counts differing by at most one, the longer stages first."""
    if num_stages < 1 or num_layers < num_stages:
        raise ValueError(f"stage={num_stages} needs at least one layer per stage; the model has {num_layers} layers")
    base, extra = divmod(num_layers, num_stages)
    return StagePlan(tuple(base + (s < extra) for s in range(num_stages)))


def num_stages(mesh: AnyMesh | None) -> int:
    return axis_size(mesh, STAGE)


def stage_mesh(mesh: Mesh, stage: int) -> Mesh:
    """The devices of one stage, as a mesh with every axis (`stage` of size 1)."""
    index = AXES.index(STAGE)
    devices = np.take(mesh.devices, [stage], axis=index)
    return Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types)


def _outside(entry: Any) -> Any:
    """A partition spec's entry for one axis, split over `stage` outside its own split."""
    inner = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return (STAGE, *inner) if inner else STAGE


def stacked_spec(spec: P, ndim: int) -> P:
    """A stage layer's spec -> the spec of its slot's stacked array (axis 0 split over `stage`
    outside whatever splits it already)."""
    parts = list(spec) + [None] * (ndim - len(spec))
    return P(_outside(parts[0]), *parts[1:])


def _zeros_like(x: jax.Array | jax.ShapeDtypeStruct) -> jax.Array:
    return jax.jit(lambda: jnp.zeros(x.shape, x.dtype), out_shardings=x.sharding)()


def _stack_leaf(mesh: Mesh, path: jax.tree_util.KeyPath, *per_stage: jax.Array) -> jax.Array:
    """One leaf of a slot: the stages' arrays (each on its stage's devices) as one array split over `stage`."""
    first = per_stage[0]
    if first.ndim == 0:
        raise ValueError(f"{jax.tree_util.keystr(path)}: a scalar weight cannot be split into pipeline stages")
    # A stage of one device may hold its layer's arrays as single-device arrays: whole, as P().
    spec = first.sharding.spec if isinstance(first.sharding, NamedSharding) else P()
    shards = []
    for x in per_stage:
        if x.shape != first.shape or x.dtype != first.dtype:
            raise ValueError(
                f"{jax.tree_util.keystr(path)}: layers of one slot differ ({x.shape} {x.dtype} vs "
                f"{first.shape} {first.dtype}); pipeline stages need the same layer structure at each slot"
            )
        shards += [shard.data for shard in x.addressable_shards]
    shape = (first.shape[0] * len(per_stage), *first.shape[1:])
    sharding = NamedSharding(mesh, stacked_spec(spec, first.ndim))
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def stack_layers(layers: Sequence[PyTree], plan: StagePlan, mesh: Mesh) -> tuple[PyTree, ...]:
    """Every layer placed on its own stage's mesh -> `plan.num_slots` slot layers whose leaves are
    split over `stage` (module docstring). Padding slots get zero arrays on their stage's devices."""
    if len(layers) != plan.num_layers:
        raise ValueError(f"{len(layers)} layers for a plan of {plan.num_layers}")
    slots = []
    for j in range(plan.num_slots):
        members = [plan.layer(s, j) for s in range(plan.num_stages)]
        template = layers[next(i for i in members if i is not None)]
        per_stage = [
            layers[i] if i is not None else jax.tree.map(_zeros_like, on_stage(template, stage_mesh(mesh, s)))
            for s, i in zip(range(plan.num_stages), members)
        ]
        slots.append(jax.tree_util.tree_map_with_path(functools.partial(_stack_leaf, mesh), *per_stage))
    return tuple(slots)


def on_stage(tree: PyTree, submesh: Mesh) -> PyTree:
    """`tree`'s arrays moved to `submesh` with the same partition specs (a padding slot's
    template, taken from a layer of another stage)."""

    def move(x: jax.Array) -> jax.ShapeDtypeStruct:
        spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else P()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(submesh, spec))

    return jax.tree.map(move, tree)


def stacked_structs(layer: PyTree, plan: StagePlan, mesh: Mesh) -> tuple[PyTree, ...]:
    """Shape structs of the slots `stack_layers` makes, from one layer's structs placed on a
    stage's mesh (every layer of a staged model has the same): to compile a staged step ahead
    of time without the weights. A struct's pinned layout (a fused weight on a TPU) is kept:
    it orders each device's block, which stacking leaves as it was."""

    def stacked(x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        sharding = x.sharding
        spec = sharding.spec if isinstance(sharding, NamedSharding) else P()
        target: Any = NamedSharding(mesh, stacked_spec(spec, x.ndim))
        layout = getattr(x.format, "layout", None)
        if layout is not None:
            target = Format(layout, target)
        return jax.ShapeDtypeStruct((x.shape[0] * plan.num_stages, *x.shape[1:]), x.dtype, sharding=target)

    slot = jax.tree.map(stacked, layer)
    return (slot,) * plan.num_slots


def stage_cache_spec(spec: P) -> P:
    """A layer cache's spec [P, page, 2K, D] -> the staged cache's [P, S*page, 2K, D] (page rows
    split over `stage`, outside a split they have already: `sequence`'s); with a leading [data]
    axis the page rows are axis 2."""
    parts = list(spec)
    parts[-3] = _outside(parts[-3])
    return P(*parts)


def stage_slots(
    slot: Callable[[int, jax.Array, PyTree, PyTree, PyTree], tuple[jax.Array, PyTree]],
    x: jax.Array,
    layers: tuple,
    caches: tuple,
    extras: PyTree,
) -> tuple[jax.Array, tuple]:
    """One stage's slots in order over `x`, inside a shard_map over `stage` (`run_stages`)."""
    out = list(caches)
    for j, layer in enumerate(layers):
        x, out[j] = slot(j, x, layer, out[j], extras)
    return x, tuple(out)


def run_stages(
    slot: Callable[[int, jax.Array, PyTree, PyTree, PyTree], tuple[jax.Array, PyTree]],
    x: jax.Array,
    slots: tuple[PyTree, ...],
    caches: tuple[PyTree, ...],
    extras: PyTree,
) -> tuple[jax.Array, tuple]:
    """The layers of every stage over activation `x` [T, E], in stage order (module docstring).

    `slot(j, x, layer, cache, extras)` runs slot j's layer on its cache: traced once for every
    stage, its `layer` leaves are the stage's own layer's and `cache` its own rows ([P, page, 2K,
    D]); `extras` (positions, metadata, ...) reach it whole. Returns the last stage's activation
    on every device and the caches."""
    if len(caches) != len(slots):
        raise ValueError(f"{len(caches)} KV caches for {len(slots)} pipeline slots")
    run_stage = functools.partial(stage_slots, slot)
    mesh = current_mesh()
    n = num_stages(mesh)

    def local(x: jax.Array, slots: tuple, caches: tuple, extras: PyTree) -> tuple[jax.Array, tuple]:
        stage = jax.lax.axis_index(STAGE)
        for t in range(n):
            x, caches = jax.lax.cond(
                stage == t, lambda x, c: run_stage(x, slots, c, extras), lambda x, c: (x, c), x, caches
            )
            if t + 1 < n:
                x = jax.lax.ppermute(x, STAGE, [(t, t + 1)])
        x = jax.lax.psum(jnp.where(stage == n - 1, x, jnp.zeros_like(x)), STAGE)
        return x, caches

    slot_specs = jax.tree.map(lambda _: P(STAGE), slots)
    cache_specs = jax.tree.map(lambda _: P(None, STAGE), caches)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), slot_specs, cache_specs, P()),
        out_specs=(P(), cache_specs),
        axis_names={STAGE},
        check_vma=False,
    )(x, slots, caches, extras)


def over_replicas(fn: Callable[..., PyTree], mesh: Mesh) -> Callable[..., PyTree]:
    """fn(shared, *per_replica) mapped over the leading [data] axis of every argument but the
    first and of every output, as `jax.vmap(..., spmd_axis_name="data")` maps a step, but by a
    shard_map over `data`: a vmapped shard_map over `stage` that holds another (the attention's
    over `tensor`) does not lower in this jax (nested batching puts `data` in both), while under
    a manual `data` axis each replica's step is traced once, unbatched."""

    def per_replica(shared: PyTree, *args: PyTree) -> PyTree:
        out = fn(shared, *jax.tree.map(lambda a: a[0], args))
        return jax.tree.map(lambda a: a[None], out)

    def mapped(shared: PyTree, *args: PyTree) -> PyTree:
        return jax.shard_map(
            per_replica,
            mesh=mesh,
            in_specs=(P(), *(P(DATA) for _ in args)),
            out_specs=P(DATA),
            axis_names={DATA},
            check_vma=False,
        )(shared, *args)

    return mapped
