"""The catalog of model families: what config reading, the loader and export know of a family
without its model code (no JAX).

Each family describes itself with one `FamilySpec` (jaxinfer/models/<family>/__init__.py): the HF
model_types and GGUF architectures it serves, how to read the config fields only it has (model.py
reads the shared ones first and hands them over), the keys it adds when a config is written back
as a config.json, what a GGUF of it leaves unsaid about its tokenizer, and a function that
imports its model code (jaxinfer.models.registry.get_family calls it on first use).

    config.json model_type      ─► spec_for_hf   ─► spec.read_hf(cfg, shared fields, source)
    GGUF general.architecture   ─► spec_for_gguf ─► spec.read_gguf(meta, arch, shared, tensors, source)
    ModelConfig.family          ─► family_spec   ─► spec.to_hf(config), spec.model(), tokenizer defaults

The built-in families are named below by module and imported on the first lookup: their
descriptors import this package (ConfigError, the shared readers) and their model code imports
ModelConfig, so config imports none of them while it is itself being imported. A family from
outside the package is added with `register` (public as jaxinfer.models.registry.register_family).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Collection, Mapping
from typing import Any

from jaxinfer.config.errors import ConfigError

# One entry per built-in family: the package whose `FAMILY` describes it.
BUILTIN_FAMILIES = ("jaxinfer.models.llama", "jaxinfer.models.moe", "jaxinfer.models.gemma")

# (config.json, the shared fields read so far, source name) -> the family's fields, and any shared
# field it reads its own way (a family whose rope is stored differently returns rope_theta too).
HFReader = Callable[[Mapping[str, Any], Mapping[str, Any], str], dict[str, Any]]
# (metadata, architecture, the shared fields, the file's tensor names or None, source name) -> fields.
GGUFReader = Callable[[Mapping[str, Any], str, Mapping[str, Any], Collection[str] | None, str], dict[str, Any]]


def no_fields(*args: Any) -> dict[str, Any]:
    """A reader for a family with nothing of its own to read."""
    return {}


def serves_every_file(meta: Mapping[str, Any], arch: str) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """One model family, as config reading and the loader see it."""

    name: str  # ModelConfig.family
    model: Callable[[], Any]  # imports the model code: -> jaxinfer.models.registry.ModelFamily
    hf_architectures: Mapping[str, str]  # HF model_type served -> architecture class written on export
    read_hf: HFReader = no_fields
    gguf_model_types: Mapping[str, str] = dataclasses.field(default_factory=dict)  # GGUF arch -> model_type
    serves_gguf: Callable[[Mapping[str, Any], str], bool] = serves_every_file  # for an arch two families list
    read_gguf: GGUFReader = no_fields
    to_hf: Callable[[Any], dict[str, Any]] = no_fields  # ModelConfig -> the family's config.json keys
    # What a GGUF of the family implies where its tokenizer metadata is silent: the chat template,
    # and texts of tokens that end generation beyond the file's EOS/EOT ids.
    chat_template: str | None = None
    end_tokens: tuple[str, ...] = ()
    hints: Mapping[str, str] = dataclasses.field(default_factory=dict)  # model_type it does not serve -> advice

    def __post_init__(self):
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"FamilySpec.name={self.name!r} must be a non-empty string")
        if not callable(self.model):
            raise ValueError(
                f"FamilySpec {self.name!r}: model={self.model!r} must be a function returning the family's ModelFamily"
            )


_SPECS: dict[str, FamilySpec] = {}
_builtins_loaded = False


def _specs() -> dict[str, FamilySpec]:
    """Every registered family, the built-in ones imported on the first call."""
    global _builtins_loaded
    if not _builtins_loaded:
        for module in BUILTIN_FAMILIES:  # before any other (`register` comes here first)
            spec = importlib.import_module(module).FAMILY
            _SPECS[spec.name] = spec
        _builtins_loaded = True
    return _SPECS


def register(spec: FamilySpec) -> None:
    """Adds a family; a ValueError names a family name or HF model_type already taken."""
    specs = _specs()
    if spec.name in specs:
        raise ValueError(f"model family {spec.name!r} is registered already")
    served = {model_type: s.name for s in specs.values() for model_type in s.hf_architectures}
    for model_type in spec.hf_architectures:
        if model_type in served:
            raise ValueError(
                f"model family {spec.name!r}: HF model_type {model_type!r} is served by "
                f"family {served[model_type]!r} already"
            )
    specs[spec.name] = spec


def family_spec(name: str) -> FamilySpec:
    specs = _specs()
    if name not in specs:
        raise ValueError(f"unknown model family {name!r}; known: {sorted(specs)}")
    return specs[name]


def spec_for_hf(model_type: str, source: str) -> FamilySpec:
    """The family serving an HF model_type; a ConfigError lists the supported ones."""
    specs = _specs().values()
    for spec in specs:
        if model_type in spec.hf_architectures:
            return spec
    hint = next((f" ({s.hints[model_type]})" for s in specs if model_type in s.hints), "")
    supported = sorted(t for s in specs for t in s.hf_architectures)
    raise ConfigError(f"{source}: unsupported model_type {model_type!r}{hint}; supported: {supported}")


def spec_for_gguf(meta: Mapping[str, Any], arch: str, source: str) -> tuple[FamilySpec, str]:
    """(the family serving a GGUF of this architecture, the file's HF model_type)."""
    specs = _specs().values()
    for spec in specs:
        if arch in spec.gguf_model_types and spec.serves_gguf(meta, arch):
            return spec, spec.gguf_model_types[arch]
    supported = sorted({a for s in specs for a in s.gguf_model_types})
    raise ConfigError(f"{source}: unsupported general.architecture {arch!r}; supported: {supported}")
