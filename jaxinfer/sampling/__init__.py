"""Sampling: SamplingParams (params.py, no JAX) and its StructuredOutput (structured_output.py),
params -> numpy SamplingArrays (arrays.py), and the sampler inside the jitted step (sampler.py).

Only the JAX-free user-facing names are exported here, so `from jaxinfer.sampling import
SamplingParams` does not import JAX; device code imports `jaxinfer.sampling.sampler` and
`jaxinfer.sampling.arrays` by name.
"""

from jaxinfer.sampling.params import GREEDY_EPS, MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams, StructuredOutput

__all__ = ["SamplingParams", "StructuredOutput", "MAX_LOGPROBS", "MAX_LOGIT_BIAS", "GREEDY_EPS"]
