"""jaxinfer: a JAX/XLA inference engine for large language models on TPUs and GPUs."""

__version__ = "0.1.0"
