"""Meshes, logical axis rules, shard-by-shard placement, sharded attention, multi-host start-up.

    mesh = make_mesh("data=2,tensor=4")             # axes (data, stage, sequence, expert, tensor)
    layout = head_layout(mesh, num_heads, num_kv_heads)
    place = make_placer(mesh, family.param_axes, layout)   # the loader's place hook
    specs = param_specs(params, family.param_axes, mesh)   # from LOGICAL_RULES

Never imports jaxinfer (the engine imports this package).
"""

from __future__ import annotations

from sharding.attention import shard_paged_attention
from sharding.mesh import (
    AXES,
    DATA,
    EXPERT,
    SEQUENCE,
    TENSOR,
    axis_size,
    current_mesh,
    format_mesh,
    make_mesh,
    parse_mesh_spec,
)
from sharding.multihost import StepChannel, initialize, is_leader, is_multiprocess
from sharding.placement import (
    DevicePlacer,
    MeshPlacer,
    Placer,
    make_placer,
    param_structs,
    per_device_bytes,
    put_sharded,
    repeat_kv_heads,
    shard_params,
)
from sharding.rules import (
    LOGICAL_RULES,
    HeadLayout,
    head_layout,
    kv_cache_spec,
    leaf_name,
    logical_to_spec,
    param_shardings,
    param_specs,
    replicated_spec,
    tokens_spec,
)
from sharding.weight_layout import pin_weight_layouts

__all__ = [
    "AXES",
    "DATA",
    "EXPERT",
    "DevicePlacer",
    "MeshPlacer",
    "Placer",
    "SEQUENCE",
    "TENSOR",
    "LOGICAL_RULES",
    "HeadLayout",
    "StepChannel",
    "axis_size",
    "current_mesh",
    "format_mesh",
    "head_layout",
    "initialize",
    "is_leader",
    "is_multiprocess",
    "kv_cache_spec",
    "leaf_name",
    "logical_to_spec",
    "make_mesh",
    "make_placer",
    "param_shardings",
    "pin_weight_layouts",
    "param_specs",
    "param_structs",
    "parse_mesh_spec",
    "per_device_bytes",
    "put_sharded",
    "replicated_spec",
    "shard_paged_attention",
    "repeat_kv_heads",
    "shard_params",
    "tokens_spec",
]
