"""The Gemma family: Gemma 2 and Gemma 3 (text), one decoder, config-driven.

__init__.py  FAMILY: what it serves and how its config is read (no JAX)
config.py    its own config fields: layer types, local rope, attention scale, soft caps
defaults.py  the chat template and end-of-turn token a GGUF of it may leave unsaid
model.py     parameters, forward pass, LM head with its soft cap, random init, assembly (JAX)
names.py     checkpoint tensor names (HF, GGUF with its 1 + w norms, ours) -> parameter fields
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxinfer.config.families import FamilySpec
from jaxinfer.models.gemma import config
from jaxinfer.models.gemma.defaults import GEMMA_CHAT_TEMPLATE, GEMMA_END_OF_TURN

if TYPE_CHECKING:  # the model code imports JAX: only when the family is used
    from jaxinfer.models.gemma.model import GemmaParams
    from jaxinfer.models.registry import ModelFamily


def model_code() -> ModelFamily[GemmaParams]:
    """The model code, imported on first use (jaxinfer.models.registry.get_family)."""
    from jaxinfer.models import linear_layout
    from jaxinfer.models.gemma import model, names
    from jaxinfer.models.registry import ModelFamily

    return ModelFamily(
        name="gemma",
        forward=model.forward,
        compute_logits=model.compute_logits,
        init_params=model.init_params,
        assemble=model.assemble,
        checkpoint_specs=names.checkpoint_specs,
        ignored_tensors=names.IGNORED,
        param_axes=model.PARAM_AXES,
        linear_inputs=model.LINEAR_INPUTS,
        compute_layout=linear_layout.linear_layout,
        traits=(
            "(1 + w) RMSNorm before and after attention and MLP",
            "GELU(tanh)-gated MLP",
            "embeddings scaled by sqrt(hidden)",
        ),
    )


FAMILY = FamilySpec(
    name="gemma",
    model=model_code,
    hf_architectures={"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"},
    read_hf=config.read_hf,
    gguf_model_types={"gemma2": "gemma2", "gemma3": "gemma3_text"},
    read_gguf=config.read_gguf,
    to_hf=config.to_hf,
    chat_template=GEMMA_CHAT_TEMPLATE,
    end_tokens=(GEMMA_END_OF_TURN,),
    hints={"gemma3": "Gemma 3 with vision: use its text-only checkpoint, gemma3_text, or a GGUF"},
)
