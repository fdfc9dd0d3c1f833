"""jaxinfer: a JAX/XLA inference engine for large language models on TPUs and GPUs.

`LLM`, `SamplingParams`, `Engine` and friends are imported lazily, so the host-side modules
(jaxinfer.core, jaxinfer.tokenizer, jaxinfer.sampling.params) stay importable without JAX.
"""

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "jaxinfer.llm",
    "SamplingParams": "jaxinfer.sampling.params",
    "StructuredOutput": "jaxinfer.sampling.params",
    "Engine": "jaxinfer.engine",
    "EngineConfig": "jaxinfer.config",
    "ModelConfig": "jaxinfer.config",
    "RequestOutput": "jaxinfer.outputs",
    "CompletionOutput": "jaxinfer.outputs",
    "load_model": "jaxinfer.loader",
    "LoRARequest": "jaxinfer.lora",
    "BeamSearchParams": "jaxinfer.sampling.beam",
    "BeamSearchOutput": "jaxinfer.outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")
