"""Putting parameters and step inputs on a mesh, one shard at a time.

`make_placer` is the loader's `place(spec, array)` hook: as each checkpoint tensor is read and
converted (a host numpy array), it is repeated along "kv_heads" when the layout asks for it and
then `jax.make_array_from_callback` copies to each device only the slice that device holds. No
device ever holds a whole unsharded tensor, and on several hosts each process fills only its own
devices (every process reads the checkpoint itself).

Checkpoints that read straight onto devices (orbax) ask the placer instead for a `target` (shape,
dtype and the sharding to read each array under; every process then reads only its own shards)
and hand the restored array to `finish`, which repeats KV heads on the devices when the layout
asks for it: those arrays are read with the KV-head axis whole, since K heads do not split over
tp > K shards.

`shard_params` does the same for a parameter tree that is already in memory (an Engine given a
model loaded without a mesh); arrays already placed as asked are kept as they are.
"""

from __future__ import annotations

import functools
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.typing import DTypeLike

from sharding.rules import HeadLayout, ParamAxes, PyTree, leaf_name, logical_to_spec
from sharding.stages import StagePlan, num_stages, plan_stages, stage_mesh
from sharding.weight_layout import weight_format


class FieldSpec(Protocol):
    """What the placer reads of the loader's tensor spec: the parameter field it fills, and the
    layer it belongs to (None: a top-level tensor)."""

    @property
    def field(self) -> str: ...

    @property
    def layer(self) -> int | None: ...


class Placer(Protocol):
    """The loader's placement hook (see the module docstring)."""

    def __call__(self, spec: FieldSpec, array: np.ndarray) -> jax.Array:
        """A host array read from a checkpoint -> the array on its device(s)."""

    def target(self, field: str, shape: tuple[int, ...], dtype: DTypeLike) -> jax.ShapeDtypeStruct:
        """What to read a saved array of this field as: shape, dtype and sharding."""

    def finish(self, field: str, array: jax.Array) -> jax.Array:
        """An array read as `target` said -> its final placement."""


def repeat_kv_heads(array: np.ndarray, axes: tuple[str, ...], repeat: int) -> np.ndarray:
    """Each KV head `repeat` times in a row, so head j' of the result is head j' // repeat.

    A fused [.., K, G+2, ..] weight (axes kv_heads, qkv) becomes [.., K*r, G/r+2, ..]: copy i of
    KV head j takes query heads i*G/r .. (i+1)*G/r of its group, and K and V whole."""
    if repeat == 1 or "kv_heads" not in axes:
        return array
    kv_axis = axes.index("kv_heads")
    if "qkv" not in axes:
        return np.repeat(array, repeat, axis=kv_axis)
    groups = np.moveaxis(array, (kv_axis, axes.index("qkv")), (0, 1))  # [K, G+2, ...]
    k, g = groups.shape[0], groups.shape[1] - 2
    queries = groups[:, :g].reshape(k * repeat, g // repeat, *groups.shape[2:])
    kv = np.repeat(groups[:, g:], repeat, axis=0)  # [K*r, 2, ...]
    fused = np.concatenate([queries, kv], axis=1)
    return np.moveaxis(fused, (0, 1), (kv_axis, axes.index("qkv")))


def repeated_shape(shape: tuple[int, ...], axes: tuple[str, ...], layout: HeadLayout) -> tuple[int, ...]:
    """The shape `repeat_kv_heads` gives an array of this shape."""
    out = list(shape)
    if "kv_heads" in axes:
        out[axes.index("kv_heads")] = layout.cache_kv_heads
        if "qkv" in axes:
            out[axes.index("qkv")] = (shape[axes.index("qkv")] - 2) // layout.kv_repeat + 2
    return tuple(out)


def put_sharded(array: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A global array from a host array; each addressable device receives only its slice."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index], dtype=array.dtype)


def place_param(name: str, array: np.ndarray, mesh: Mesh, param_axes: ParamAxes, layout: HeadLayout) -> jax.Array:
    """One parameter's host array, its KV heads repeated as the layout asks, placed on the mesh."""
    axes = param_axes[name]
    array = repeat_kv_heads(np.asarray(array), axes, layout.kv_repeat)
    return put_sharded(array, NamedSharding(mesh, logical_to_spec(axes, array.shape, mesh)))


class DevicePlacer:
    """Every parameter whole on one device (the default device when none is given)."""

    def __init__(self, device: jax.Device | None = None) -> None:
        self.device = device or jax.devices()[0]

    def __call__(self, spec: FieldSpec, array: np.ndarray) -> jax.Array:
        return jax.device_put(array, self.device)

    def target(self, field: str, shape: tuple[int, ...], dtype: DTypeLike) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(self.device))

    def finish(self, field: str, array: jax.Array) -> jax.Array:
        return array


class MeshPlacer:
    """Every parameter split over the mesh by its logical axes, KV heads repeated as `layout` asks;
    with `repeat_kv=False` KV heads stay as the checkpoint has them (kept whole where they do not
    split), the layout `jaxinfer convert` saves. With pipeline stages (`stages`) a layer's
    tensors go to its own stage's devices only (sharding/stages.py stacks them later)."""

    def __init__(
        self,
        mesh: Mesh,
        param_axes: ParamAxes,
        layout: HeadLayout,
        repeat_kv: bool = True,
        stages: StagePlan | None = None,
    ) -> None:
        self.mesh, self.param_axes, self.layout, self.repeat_kv = mesh, param_axes, layout, repeat_kv
        self.stages = stages

    def __call__(self, spec: FieldSpec, array: np.ndarray) -> jax.Array:
        if not self.repeat_kv:
            return put_sharded(array, self.target(spec.field, array.shape, array.dtype).sharding)
        layer = spec.layer
        mesh = self.mesh if self.stages is None or layer is None else stage_mesh(self.mesh, self.stages.stage_of(layer))
        return place_param(spec.field, array, mesh, self.param_axes, self.layout)

    def _repeats(self, field: str) -> bool:
        return self.layout.kv_repeat > 1 and "kv_heads" in self.param_axes[field]

    def target(self, field: str, shape: tuple[int, ...], dtype: DTypeLike) -> jax.ShapeDtypeStruct:
        axes = self.param_axes[field]
        spec = logical_to_spec(axes, shape, self.mesh, strict=not self._repeats(field))
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(self.mesh, spec))

    def finish(self, field: str, array: jax.Array) -> jax.Array:
        if not (self.repeat_kv and self._repeats(field)):
            return array
        axes = self.param_axes[field]
        if "qkv" in axes:
            raise ValueError(f"{field}: fused q|k|v weights are saved unfused; cannot repeat KV heads")
        shape = repeated_shape(tuple(array.shape), axes, self.layout)
        out = NamedSharding(self.mesh, logical_to_spec(axes, shape, self.mesh))
        repeat = functools.partial(jnp.repeat, repeats=self.layout.kv_repeat, axis=axes.index("kv_heads"))
        return jax.jit(repeat, out_shardings=out)(array)


def make_placer(mesh: Mesh, param_axes: ParamAxes, layout: HeadLayout, num_layers: int | None = None) -> MeshPlacer:
    """The loader hook for a mesh: place(tensor_spec, host_array) -> sharded jax.Array (with
    pipeline stages and `num_layers` given, each layer's on its stage's devices)."""
    stages = plan_stages(num_layers, num_stages(mesh)) if num_layers is not None and num_stages(mesh) > 1 else None
    return MeshPlacer(mesh, param_axes, layout, stages=stages)


def _placed_shape(
    name: str, shape: tuple[int, ...], param_axes: ParamAxes, mesh: Mesh, layout: HeadLayout
) -> tuple[tuple[int, ...], NamedSharding]:
    """A parameter's shape on the mesh (KV heads repeated where the layout asks) and sharding."""
    axes = param_axes[name]
    repeated = "kv_heads" not in axes or shape[axes.index("kv_heads")] == layout.cache_kv_heads
    shape = tuple(shape) if repeated else repeated_shape(shape, axes, layout)
    return shape, NamedSharding(mesh, logical_to_spec(axes, shape, mesh))


def param_structs(params: PyTree, param_axes: ParamAxes, mesh: Mesh, layout: HeadLayout) -> PyTree:
    """What `shard_params` and `pin_weight_layouts` would make of a tree of parameters (arrays or
    shape structs), as shape structs with their shardings (and, for fused weights on a TPU, their
    pinned layout): to compile a step ahead of time without the weights."""

    def struct(path: jax.tree_util.KeyPath, x: jax.Array | jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        name = leaf_name(path)
        shape, sharding = _placed_shape(name, x.shape, param_axes, mesh, layout)
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=weight_format(name, shape, sharding, param_axes))

    return jax.tree_util.tree_map_with_path(struct, params)


def shard_params(params: PyTree, param_axes: ParamAxes, mesh: Mesh, layout: HeadLayout) -> PyTree:
    """Places an in-memory parameter tree on the mesh (a no-op for arrays placed already)."""

    def place(path: jax.tree_util.KeyPath, x: jax.Array | np.ndarray) -> jax.Array:
        name = leaf_name(path)
        shape, target = _placed_shape(name, x.shape, param_axes, mesh, layout)
        if shape == x.shape and isinstance(x, jax.Array) and x.sharding.is_equivalent_to(target, x.ndim):
            return x
        if shape == x.shape:  # only the placement differs: device to device
            return jax.device_put(x, target)
        return place_param(name, np.asarray(x), mesh, param_axes, layout)

    return jax.tree_util.tree_map_with_path(place, params)


def per_device_bytes(tree: PyTree) -> dict[jax.Device, int]:
    """Bytes each device holds of a tree of arrays: {device: bytes}."""
    out: dict[jax.Device, int] = {}
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out
