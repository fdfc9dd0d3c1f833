"""Model code, one folder per family, and what the families share.

    registry.py     ModelFamily (the model code the loader and the worker use), get_family,
                    register_family (a family from outside the package)
    layers.py       norms, rope, the q|k|v and gated-MLP matmuls, paged attention, the decoder stack
    experts.py      a mixture of experts' MLP (routing, the experts' forms)
    specs.py        TensorSpec: one checkpoint tensor -> one parameter
    reading.py      a family's parameters read out of a checkpoint: checked, converted, placed
    <family>/       llama/, moe/, gemma/: __init__.py describes the family (FamilySpec, no JAX),
                    config.py reads its own config fields, model.py and names.py its model code

This package and each family's __init__.py and config.py import no JAX, so config reading
(jaxinfer.config.families) loads a family's description without its model code.
"""
