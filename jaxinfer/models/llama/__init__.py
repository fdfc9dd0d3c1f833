"""The Llama family: Llama 2/3/3.x, Mistral, Qwen2/2.5, Qwen3, SmolLM2 (one decoder, config-driven).

__init__.py  FAMILY: what it serves and how its config is read (no JAX)
config.py    its own config fields: Qwen biases and QK-norm, sliding windows
model.py     parameters, forward pass, LM head, random init, assembly (JAX)
names.py     checkpoint tensor names (HF, GGUF, ours) -> parameter fields
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxinfer.config.families import FamilySpec
from jaxinfer.models.llama import config

if TYPE_CHECKING:  # the model code imports JAX: only when the family is used
    from jaxinfer.models.llama.model import LlamaParams
    from jaxinfer.models.registry import ModelFamily


def model_code() -> ModelFamily[LlamaParams]:
    """The model code, imported on first use (jaxinfer.models.registry.get_family)."""
    from jaxinfer.models import linear_layout
    from jaxinfer.models.llama import model, names
    from jaxinfer.models.registry import ModelFamily

    return ModelFamily(
        name="llama",
        forward=model.forward,
        tick=model.tick,
        compute_logits=model.compute_logits,
        init_params=model.init_params,
        assemble=model.assemble,
        checkpoint_specs=names.checkpoint_specs,
        ignored_tensors=names.IGNORED,
        param_axes=model.PARAM_AXES,
        linear_inputs=model.LINEAR_INPUTS,
        compute_layout=linear_layout.linear_layout,
    )


FAMILY = FamilySpec(
    name="llama",
    model=model_code,
    hf_architectures={
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    },
    read_hf=config.read_hf,
    gguf_model_types={arch: arch for arch in ("llama", "mistral", "qwen2", "qwen3")},
    serves_gguf=config.serves_gguf,
    read_gguf=config.read_gguf,
    to_hf=config.to_hf,
)
