"""Pipeline stages on the worker side: what a staged engine accepts, and its parameters placed
stage by stage (the layout itself: sharding/stages.py).

With `stage=S` in the mesh every layer is placed on its own stage's devices only and the layers
are then stacked into slots split over `stage`; the embedding, final norm and LM head are placed
over the whole mesh as without stages. A model or option the staged forward does not carry yet is
refused here, by name, before anything is placed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.config.kv_layout import kv_layout
from jaxinfer.models.registry import ModelParams
from sharding import HeadLayout, shard_params
from sharding.rules import ParamAxes
from sharding.stages import StagePlan, num_stages, plan_stages, stack_layers, stage_mesh


def stage_plan(config: ModelConfig, engine: EngineConfig, mesh: Mesh | None) -> StagePlan | None:
    """The stages of `mesh` for this model (None without stages); a ValueError names what a
    staged engine does not support yet."""
    n = num_stages(mesh)
    if n == 1:
        return None
    plan = plan_stages(config.num_layers, n)
    refused = {
        "LoRA adapters (--enable-lora)": engine.lora.enable_lora,
        f"{config.model_type}'s mix of sliding-window and full-attention layers": kv_layout(config).num_groups > 1,
    }
    for what, present in refused.items():
        if present:
            raise ValueError(f"mesh stage={n}: pipeline stages do not support {what} yet")
    for j in range(plan.num_slots):  # one slot is one traced body: its layers must be built alike
        layers = [i for s in range(n) if (i := plan.layer(s, j)) is not None]
        if len({config.is_moe_layer(i) for i in layers}) > 1:
            kinds = ", ".join(f"{i}: {'experts' if config.is_moe_layer(i) else 'dense'}" for i in layers)
            raise ValueError(
                f"mesh stage={n}: layers {layers} share pipeline slot {j} but mix dense and expert MLPs ({kinds}); "
                "a stage count that lines the model's dense layers up works"
            )
    return plan


def place_staged(params: Any, axes: ParamAxes, mesh: Mesh, layout: HeadLayout, plan: StagePlan) -> ModelParams:
    """The top-level weights over the whole mesh, each layer on its stage's devices, then the
    layers stacked into the plan's slots (no data moves for layers placed there already).
    `params`: a family's parameter dataclass (its `layers` a tuple), LoRA stacks not attached."""
    top = shard_params(dataclasses.replace(params, layers=()), axes, mesh, layout)
    layers = [
        shard_params(layer, axes, stage_mesh(mesh, plan.stage_of(i)), layout) for i, layer in enumerate(params.layers)
    ]
    return dataclasses.replace(top, layers=stack_layers(layers, plan, mesh))
