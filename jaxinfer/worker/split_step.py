"""SplitStep: the step split in two halves, for structured output (CompiledStep's split buckets).

The forward (K/V written, the last tokens' hidden rows out) is dispatched before a grammar's
allowed-token bits are filled; the LM head and sampling after, with the bits as they are then.
CompiledStep (compiled_step.py) inherits these two launches; the worker (worker.py) calls them
for a bucket in `split_buckets`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Future

import jax
import numpy as np

from jaxinfer.sampling.arrays import HostOrDevice, SamplingArrays
from jaxinfer.sampling.device_defaults import DeviceDefaults
from jaxinfer.sampling.sampler import SamplerOutput
from jaxinfer.worker.device_state import DeviceState
from jaxinfer.worker.launcher import Launcher, landed
from jaxinfer.worker.page_table import DevicePageTable
from jaxinfer.worker.step import StepOutput
from jaxinfer.worker.step_inputs import StepInputs
from jaxinfer.worker.step_variants import input_shardings
from sharding.multihost import put_inputs


class SplitStep:
    """The two halves' launches; the attributes are CompiledStep's."""

    state: DeviceState
    launcher: Launcher
    page_table: DevicePageTable
    mesh: jax.sharding.Mesh | None
    num_replicas: int
    _defaults: DeviceDefaults
    _prev_tokens: jax.Array
    _forward: jax.stages.Wrapped
    _sample: jax.stages.Wrapped

    _placed: Callable[[StepInputs[np.ndarray]], StepInputs[HostOrDevice]]
    _set_table: Callable[[StepInputs[HostOrDevice]], StepInputs[HostOrDevice]]

    def dispatch_forward(self, inputs: StepInputs[np.ndarray]) -> jax.Array | Future[jax.Array]:
        """The first half of a split step (a bucket in `split_buckets`): the forward, K/V
        written. Returns the last tokens' hidden rows on the device, for `dispatch_sample`."""
        state = self.state

        def launch(inputs: StepInputs[HostOrDevice]) -> jax.Array:
            with state.mesh_context():
                inputs = self._set_table(inputs)
                hidden, state.kv_caches = self._forward(
                    state.params, state.kv_caches, inputs, self._prev_tokens, self.page_table.array
                )
            return hidden

        return self.launcher.submit(launch, self._placed(dataclasses.replace(inputs, sampling=None)))

    def dispatch_sample(
        self, hidden: jax.Array | Future[jax.Array], inputs: StepInputs[np.ndarray]
    ) -> StepOutput | Future[StepOutput]:
        """The second half: LM head and sampling with `inputs.sampling` as it is now (its
        allowed-token bits may have been filled after `dispatch_forward`)."""
        rows = None if inputs.lora_slots is None else inputs.lora_slots[inputs.logits_indices]  # LM head LoRA

        def launch(sampling: SamplingArrays[HostOrDevice]) -> SamplerOutput:
            with self.state.mesh_context():
                out, self._prev_tokens = self._sample(self.state.params, landed(hidden), sampling, rows)
            return out

        return self.launcher.submit(
            launch,
            self._defaults.fill(
                inputs.sampling
                if self.mesh is None
                else put_inputs(inputs.sampling, input_shardings(self.mesh, inputs, self.num_replicas > 1).sampling)
            ),
        )
