"""Weight-only quantization: the quantized weight pytree and the einsum the linear layers call
(weights.py), float weights held out-first for the CPU step (out_first.py), fusing weights of
differing layouts (fuse.py), GGUF blocks kept quantized (gguf_blocks.py, gguf.py), and the
load-time options and checkpoint naming (config.py)."""

from jaxinfer.quant.config import (
    CHOICES,
    DEFAULT_GROUP_SIZE,
    EMBEDDING_INPUTS,
    METHODS,
    QuantConfig,
    component_specs,
    flat_arrays,
    join_components,
    quantize_field,
    resolve,
    stored_components,
)
from jaxinfer.quant.fuse import fuse, stack, unstack
from jaxinfer.quant.inspect import param_bytes, param_count, quantization_of, quantized_tensors
from jaxinfer.quant.out_first import OutFirstWeight
from jaxinfer.quant.weights import QuantizedWeight, dequantize, einsum, embedding_rows

__all__ = [
    "CHOICES",
    "DEFAULT_GROUP_SIZE",
    "EMBEDDING_INPUTS",
    "METHODS",
    "OutFirstWeight",
    "QuantConfig",
    "QuantizedWeight",
    "component_specs",
    "dequantize",
    "einsum",
    "embedding_rows",
    "flat_arrays",
    "fuse",
    "join_components",
    "param_bytes",
    "param_count",
    "quantization_of",
    "quantize_field",
    "quantized_tensors",
    "resolve",
    "stack",
    "stored_components",
    "unstack",
]
