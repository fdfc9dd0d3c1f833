"""Configuration, free of JAX until an engine is built from it.

    engine.py       EngineConfig: serving limits and the static shapes the step compiles for
    speculative.py  SpeculativeConfig: speculative decoding's method and sizes
    model.py        ModelConfig, read from an HF config.json or GGUF metadata
"""
from jaxinfer.config.engine import EngineConfig
from jaxinfer.config.model import ConfigError, ModelConfig, RopeScaling
from jaxinfer.config.speculative import SpeculativeConfig

__all__ = ["ConfigError", "EngineConfig", "ModelConfig", "RopeScaling", "SpeculativeConfig"]
