"""Device meshes from a spec string, and the mesh a traced function runs under.

Every mesh has the same five axes, in this order: `data` (independent replicas, outermost),
`stage` (pipeline stages: contiguous runs of layers, each stage's weights and caches only on its
devices; sharding/stages.py), `sequence` (a step's tokens and each page's rows of the KV cache
split over it: contexts of several devices' pools; sharding/attention.py),
`expert` (a mixture's experts split between devices; everything else is replicated over it) and
`tensor` (heads and MLP columns, innermost so its collectives stay between neighbouring devices).
A spec names only the axes it uses; the others have size 1, so partition specs can always name
all five. `stage` sits outside everything but `data`: on several hosts its neighbours are whole
hosts, and only one activation per step crosses between them.

    make_mesh("data=2,tensor=4")   # 8 devices: 2 replicas of a 4-way tensor-parallel model
    make_mesh("expert=4,tensor=2") # 8 devices: each holds a quarter of the experts, half of each
    make_mesh("stage=2,tensor=4")  # 8 devices: layers split in two halves, each 4-way tensor-parallel

Axis types are Auto: `with_sharding_constraint`, sharded `jit` and `jax.shard_map` all work.
The runner traces its step under `jax.set_mesh(mesh)`, and layers read it back with
`current_mesh()` instead of taking a mesh argument (model code stays free of engine flags).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

DATA, STAGE, SEQUENCE, EXPERT, TENSOR = "data", "stage", "sequence", "expert", "tensor"
AXES = (DATA, STAGE, SEQUENCE, EXPERT, TENSOR)
_ITEM = re.compile(r"^\s*([a-z]+)\s*=\s*(\d+)\s*$")
# A concrete mesh, or the abstract one a function is traced under (`current_mesh()`).
AnyMesh = Mesh | AbstractMesh


def parse_mesh_spec(spec: object) -> dict[str, int]:
    """ "data=2,tensor=4" (or a dict) -> {"data": 2, "stage": 1, "sequence": 1, "expert": 1, "tensor": 4};
    a ValueError names anything else (a config's value, checked here)."""
    if isinstance(spec, dict):
        items = list(spec.items())
    else:
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"mesh spec must be a string such as 'data=2,tensor=4', got {spec!r}")
        items = []
        for part in spec.split(","):
            match = _ITEM.match(part)
            if not match:
                raise ValueError(f"mesh spec {spec!r}: {part!r} is not axis=size")
            items.append((match.group(1), int(match.group(2))))
    sizes = dict.fromkeys(AXES, 1)
    seen = set()
    for name, size in items:
        if name not in sizes:
            raise ValueError(f"mesh spec {spec!r}: unknown axis {name!r}; axes are {AXES}")
        if name in seen:
            raise ValueError(f"mesh spec {spec!r}: axis {name!r} given twice")
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh spec {spec!r}: axis {name!r} needs a positive size, got {size!r}")
        seen.add(name)
        sizes[name] = size
    return sizes


def make_mesh(spec: object, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, stage, sequence, expert, tensor) mesh over the first prod(sizes) of `devices` (default: all).
    `spec`: a Mesh (returned as it is), or what parse_mesh_spec reads ("data=2,tensor=4", a dict).

    Devices are taken in jax.devices() order, which groups each host's devices together, so the
    tensor axis (innermost) never crosses hosts unless it is larger than one host.
    """
    if isinstance(spec, Mesh):
        return spec
    sizes = parse_mesh_spec(spec)
    devices = list(jax.devices() if devices is None else devices)
    need = math.prod(sizes.values())
    if need > len(devices):
        raise ValueError(f"mesh {format_mesh(sizes)} needs {need} devices, but only {len(devices)} are available")
    grid = np.array(devices[:need], dtype=object).reshape([sizes[a] for a in AXES])
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def format_mesh(sizes: dict[str, int] | Mesh) -> str:
    if isinstance(sizes, Mesh):
        sizes = dict(sizes.shape)
    return ",".join(f"{a}={sizes.get(a, 1)}" for a in AXES)


def current_mesh() -> AbstractMesh | None:
    """The mesh the caller is traced under (jax.set_mesh), or None outside any mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(AXES) <= set(mesh.axis_names):
        return None
    return mesh


def axis_size(mesh: AnyMesh | None, name: str) -> int:
    return 1 if mesh is None else dict(mesh.shape).get(name, 1)
