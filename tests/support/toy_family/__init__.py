"""ToyLlama: a model family defined outside the package, registered by the tests alone.

A Llama whose two residual branches are scaled by RESIDUAL_SCALE (x + s * attention(x), then
x + s * mlp(x)) and whose checkpoints name their tensors their own way, stored [in, out]
(model.py). It serves config.json model_type "toyllama" and reads its config as Llama does.

    register_family(toy_family.FAMILY)   then   LLM("dir with a toyllama config.json")

Like a built-in family, this descriptor imports no JAX; `model_code` imports the model code
the first time the family is used.
"""

from __future__ import annotations

from jaxinfer.config.families import FamilySpec
from jaxinfer.models.llama import config as llama_config

RESIDUAL_SCALE = 0.5


def model_code():
    from toy_family import model

    return model.family()


FAMILY = FamilySpec(
    name="toyllama",
    model=model_code,
    hf_architectures={"toyllama": "ToyLlamaForCausalLM"},
    read_hf=llama_config.read_hf,
)
