"""Weight-only quantization: the quantized weight pytree and the einsum the linear layers call
(weights.py), and the load-time options and checkpoint naming (config.py)."""
from jaxinfer.quant.config import (DEFAULT_GROUP_SIZE, METHODS, QuantConfig, component_specs,
                                   flat_arrays, join_components, param_bytes, param_count,
                                   quantization_of, quantize_field)
from jaxinfer.quant.weights import QuantizedWeight, dequantize, einsum

__all__ = ["DEFAULT_GROUP_SIZE", "METHODS", "QuantConfig", "QuantizedWeight", "component_specs",
           "dequantize", "einsum", "flat_arrays", "join_components", "param_bytes", "param_count",
           "quantization_of", "quantize_field"]
