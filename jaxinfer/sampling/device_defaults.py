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
from jax.sharding import Mesh, NamedSharding, Sharding
from jax.typing import DTypeLike

from jaxinfer.sampling.arrays import HostOrDevice, SamplingArrays, fill_defaults
from sharding import replicated_spec
from sharding.multihost import put_inputs


class DeviceDefaults:
    """`fill(sampling)`: the arrays with their unsent defaults taken from device arrays, on `home`
    without a mesh (where the arrays a batch did send are committed too), else replicated over
    `mesh` (per data replica with several)."""

    def __init__(self, vocab_size: int, home: Sharding, mesh: Mesh | None = None, num_replicas: int = 1):
        self.vocab_size = vocab_size
        self.home = home if mesh is None else None
        self.where = home if mesh is None else NamedSharding(mesh, replicated_spec(replicas=num_replicas > 1))
        self._arrays: dict[tuple, jax.Array] = {}

    def fill(self, sampling: SamplingArrays[HostOrDevice] | None) -> SamplingArrays[HostOrDevice] | None:
        """`sampling` (host arrays, or placed on a mesh) with every unsent default filled."""
        if sampling is None:
            return None
        if (home := self.home) is not None:  # the defaults a batch did send (UNSENT_DEFAULTS), committed
            put = lambda x: None if x is None else jax.device_put(x, home)  # noqa: E731
            sampling = dataclasses.replace(
                sampling,
                allowed=put(sampling.allowed),
                bias_ids=put(sampling.bias_ids),
                bias_values=put(sampling.bias_values),
            )
        return fill_defaults(sampling, self.vocab_size, self._full)

    def _full(self, shape: tuple[int, ...], value: int, dtype: DTypeLike) -> jax.Array:
        key = (shape, value, np.dtype(dtype).str)
        if key not in self._arrays:
            self._arrays[key] = put_inputs(np.full(shape, value, dtype), self.where)
        return self._arrays[key]
