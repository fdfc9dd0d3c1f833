"""The MoE family: Mixtral and Qwen3-MoE, mixtures of experts on Llama's attention.

__init__.py  FAMILY: what it serves and how its config is read (no JAX)
config.py    its own config fields: the experts, and Llama's attention fields
model.py     parameters, forward pass, random init, assembly, the experts' layout (JAX);
             the experts' MLP itself is shared (models/experts.py)
names.py     checkpoint tensor names (HF per expert, GGUF stacked) -> parameter fields
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxinfer.config.families import FamilySpec
from jaxinfer.models.moe import config

if TYPE_CHECKING:  # the model code imports JAX: only when the family is used
    from jaxinfer.models.moe.model import MoeParams
    from jaxinfer.models.registry import ModelFamily


def model_code() -> ModelFamily[MoeParams]:
    """The model code, imported on first use (jaxinfer.models.registry.get_family)."""
    from jaxinfer.models.moe import model, names
    from jaxinfer.models.registry import ModelFamily

    return ModelFamily(
        name="moe",
        forward=model.forward,
        tick=model.tick,
        compute_logits=model.compute_logits,
        init_params=model.init_params,
        assemble=model.assemble,
        checkpoint_specs=names.checkpoint_specs,
        ignored_tensors=names.IGNORED,
        param_axes=model.PARAM_AXES,
        linear_inputs=model.LINEAR_INPUTS,
        compute_layout=model.compute_layout,
    )


FAMILY = FamilySpec(
    name="moe",
    model=model_code,
    hf_architectures={"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"},
    read_hf=config.read_hf,
    gguf_model_types={"llama": "mixtral", "qwen3moe": "qwen3_moe"},  # llama.cpp: Mixtral is "llama" with experts
    serves_gguf=config.serves_gguf,
    read_gguf=config.read_gguf,
    to_hf=config.to_hf,
)
