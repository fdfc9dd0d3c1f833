"""The sampling defaults a batch leaves unsent (arrays.unsent_defaults), kept on the device.

A batch with no grammar row or no logit bias sends no allowed bits or bias rows; the compiled step fills
them here from device arrays made once per shape, so every batch reaches the step with the same
structure of committed device arrays and runs the same compiled variant. Plain arrays
(SamplingArrays.plain) stay as they are: their sampler reads neither.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxinfer.sampling.arrays import UNSENT_DEFAULTS, SamplingArrays, fill_defaults
from sharding import replicated_spec
from sharding.multihost import put_inputs


class DeviceDefaults:
    """`fill(sampling)`: the arrays with their unsent defaults taken from device arrays, on `home`
    without a mesh (where the arrays a batch did send are committed too), else replicated over
    `mesh` (per data replica with several)."""

    def __init__(self, vocab_size: int, home, mesh=None, num_replicas: int = 1):
        self.vocab_size = vocab_size
        self.home = home if mesh is None else None
        self.where = home if mesh is None else NamedSharding(mesh, replicated_spec(replicas=num_replicas > 1))
        self._arrays: dict[tuple, jax.Array] = {}

    def fill(self, sampling: SamplingArrays | None) -> SamplingArrays | None:
        if sampling is None:
            return None
        if self.home is not None:
            sampling = dataclasses.replace(
                sampling,
                **{
                    name: jax.device_put(x, self.home)
                    for name in UNSENT_DEFAULTS
                    if (x := getattr(sampling, name)) is not None
                },
            )
        return fill_defaults(sampling, self.vocab_size, self._full)

    def _full(self, shape: tuple[int, ...], value, dtype) -> jax.Array:
        key = (shape, value, np.dtype(dtype).str)
        if key not in self._arrays:
            self._arrays[key] = put_inputs(np.full(shape, value, dtype), self.where)
        return self._arrays[key]
