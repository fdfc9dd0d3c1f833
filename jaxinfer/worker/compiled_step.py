"""CompiledStep: the one jitted step over a ragged batch, its compiled variants, and its launch.

Data flow of a step:
    SchedulerPlan --prepare (inputs.InputBuilder)--> StepInputs (numpy, padded to a token bucket
    T and its sequence bucket S) --dispatch--> ONE jitted call: forward over the ragged batch (each
    layer writes its new K/V into the paged cache and attends) -> logits of each sequence's last
    token -> in-jit sampling -> int32 tokens and logprobs, left on the device --fetch--> numpy.

`dispatch` returns the step's outputs still on the device, so the engine can plan and dispatch the
next step before they arrive (async scheduling): each step also hands the next one its sampled
tokens (padded to the largest sequence bucket, so no new variants), which fill the next step's
placeholder input ids inside the jit (StepInputs.prev_rows). `execute` is dispatch + fetch.
With the launcher's thread (EngineConfig.dispatch_thread, launcher.py) a dispatch hands the
jitted call to that thread and returns a Future of its outputs; `fetch` waits for both.

Every variant (step_variants.py: token buckets, penalty history, prompt logprobs, decode windows,
the greedy twin, the split step of structured output) compiles in `warm_up` (or, without it, when
a step first needs it); the executable store (programs.py, executables.py) and JAX's persistent
compilation cache make later start-ups cheap. The KV caches of the DeviceState are donated to
each launch and replaced by the ones it returns. Padding rows write nowhere and their page-table
rows point at the null page 0, which no sequence owns. The block tables stay on the device
(page_table.py): a step sends only the entries that changed, set in place before it runs.

On a mesh the step's token ids and positions are split over `sequence` and the step is traced
under `jax.set_mesh`; with `data` > 1 step inputs get a leading [data] axis (one scheduler per
replica fills its row) and the step is vmapped over it, so all replicas run in one call.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from concurrent.futures import Future
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.core.plan import SchedulerPlan
from jaxinfer.lora.peft import Adapter
from jaxinfer.sampling.arrays import HostOrDevice
from jaxinfer.sampling.device_defaults import DeviceDefaults
from jaxinfer.worker.background import BackgroundCompile, groups, serving_order
from jaxinfer.worker.device_state import DeviceState
from jaxinfer.worker.inputs import InputBuilder
from jaxinfer.worker.launcher import Launcher, dispatch_thread_enabled, landed
from jaxinfer.worker.page_table import DevicePageTable
from jaxinfer.worker.programs import Programs, executable_store
from jaxinfer.worker.split_step import SplitStep
from jaxinfer.worker.step import StepOutput
from jaxinfer.worker.step_inputs import StepInputs
from jaxinfer.worker.step_variants import (
    as_greedy,
    decode_sized_buckets,
    decode_steps,
    greedy_variant_enabled,
    input_shardings,
    split_step_enabled,
    step_jits,
    window_compiler_options,
    without_adapters,
)
from jaxinfer.worker.warm_up import compile_all, compile_threads, step_variants
from sharding import DATA, SEQUENCE, axis_size
from sharding.multihost import fetch, put_inputs

logger = logging.getLogger(__name__)


class CompiledStep(SplitStep):
    def __init__(self, state: DeviceState, in_flight: int = 1) -> None:
        engine, self.state, self.config = state.engine, state, state.config
        self.engine, self.mesh, self.num_replicas = engine, state.mesh, state.num_replicas
        sp = axis_size(self.mesh, SEQUENCE)  # token buckets split evenly over the sequence axis
        self.buckets = tuple(sorted({-(-b // sp) * sp for b in engine.buckets()}))
        spec = engine.speculative_config
        self.inputs = InputBuilder(
            engine,
            self.buckets,
            pages_per_seq=state.pages_per_seq,
            max_model_len=state.max_model_len,
            vocab_size=self.config.vocab_size,
            num_replicas=self.num_replicas,
            num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
            num_groups=state.kv_layout.num_groups,
            in_flight=in_flight,  # batches in flight at once (pipelined.py)
        )
        max_seqs = engine.seq_bucket(self.buckets[-1])  # the sampled-token width handed on
        prev_shape = (max_seqs,) if self.num_replicas == 1 else (self.num_replicas, max_seqs)
        # Every array the step carries over (KV caches, sampled tokens) is committed to the
        # params' device(s) from the start: an uncommitted first value would give the step a
        # second signature (and a compile after warm-up) once its committed outputs come back.
        # The caches come back in their own formats: placement and pinned row-major layout.
        home = state.home
        formats = jax.tree.map(lambda c: c.format, state.kv_caches)
        out_shardings = (None, formats, None) if self.mesh is None else (home, formats, home)
        self._prev_tokens = jax.device_put(jnp.zeros(prev_shape, jnp.int32), home)
        # The sequences' block tables stay on the device, shaped like the builder's host mirror.
        self.page_table = DevicePageTable(*self.inputs.tables[0].rows.shape, home, self.num_replicas, DATA)
        self._defaults = DeviceDefaults(self.config.vocab_size, home, self.mesh, self.num_replicas)
        # Decode windows (EngineConfig.num_decode_steps): one variant per decode-sized bucket.
        self.num_decode_steps = decode_steps(engine.scheduler.num_decode_steps, self.num_replicas)
        self._step, self._window, self._forward, self._sample = step_jits(
            state.family,
            self.config,
            engine.compile.attn_impl,
            max_seqs,
            self.num_replicas,
            self.num_decode_steps,
            out_shardings,
            window_compiler_options() if self.num_decode_steps > 1 else None,
            state.mesh,
        )
        decode_sized = decode_sized_buckets(self.inputs, self.buckets, engine.scheduler.max_num_seqs)
        self.window_buckets = decode_sized if self.num_decode_steps > 1 else ()
        # The step split in two (structured output: masks filled while the forward runs).
        self.split_buckets = (
            decode_sized if split_step_enabled(engine.compile.structured_output_overlap, self.num_replicas) else ()
        )
        # The greedy twin of each decode-sized bucket's decode step: its window, if windows run.
        greedy = greedy_variant_enabled(engine.compile.greedy_variant, self.num_replicas)
        self.greedy_buckets = decode_sized if greedy else ()
        self.greedy_steps = self.num_decode_steps
        self.launcher = Launcher(dispatch_thread_enabled(engine.compile.dispatch_thread))
        self._jits = {"step": self._step, "window": self._window}
        self.background: BackgroundCompile | None = None  # warm_up(background=True)
        self.programs = Programs(
            executable_store(engine, self.config, state.mesh, state.local_device), state.mesh_context
        )

    def prepare(
        self, plan: SchedulerPlan | list[SchedulerPlan], previous: list[SchedulerPlan] | None = None, masks: bool = True
    ) -> StepInputs[np.ndarray]:
        """Padded numpy inputs of one step (one plan per data replica); `previous`: the plans of
        the step in flight, whose sampled tokens the placeholders of this one stand for;
        `masks=False` leaves grammar rows' allowed bits for `inputs.fill_masks` (split step)."""
        return self.inputs.prepare(plan, previous, masks)

    def padding_inputs(
        self, t_bucket: int, with_history: bool, spec: bool = False, prompt: bool = False, table_width: int = 0
    ) -> StepInputs[np.ndarray]:
        """All-padding inputs of one bucket: the step writes nothing and reads the null page."""
        return self.inputs.padding_inputs(t_bucket, with_history, spec, prompt, table_width)

    def execute(self, inputs: StepInputs[np.ndarray], num_steps: int = 1, greedy: bool = True) -> StepOutput:
        """Runs the step and waits for it. Returns numpy outputs (with a leading [data] axis when
        there are several replicas; a decode window's have a leading [num_steps] axis)."""
        return self.fetch(self.dispatch(inputs, num_steps, greedy))

    @staticmethod
    def fetch(out: StepOutput | Future[StepOutput]) -> StepOutput:
        """A dispatch's outputs as numpy, once its launch has returned and the device is done."""
        return fetch(landed(out))

    def dispatch(
        self, inputs: StepInputs[np.ndarray], num_steps: int = 1, greedy: bool = True
    ) -> StepOutput | Future[StepOutput]:
        """Starts the step (num_steps > 1: the decode window of a decode-only plan); the KV cache
        is donated and replaced. Returns the outputs on the device (ready once it is done), or
        with the launcher's thread on, a Future of them (launcher.landed). Inputs that qualify
        run the greedy twin (`greedy_buckets`) unless `greedy` is False."""
        return self.launcher.submit(self._launch, *self._prepared(inputs, num_steps, greedy and self.complete))

    def _prepared(
        self, inputs: StepInputs[np.ndarray], num_steps: int, greedy: bool
    ) -> tuple[str, StepInputs[HostOrDevice]]:
        """The variant's program name and its placed inputs (the greedy twin's where they qualify)."""
        buckets, inputs = self.greedy_buckets if greedy else (), without_adapters(inputs, self.engine.lora)
        return self._variant(num_steps), self._placed(as_greedy(inputs, num_steps, buckets, self.greedy_steps))

    def _launch(self, name: str, inputs: StepInputs[HostOrDevice]) -> StepOutput:
        """On the launcher: the page-table entries set, then the step (programs.py: through
        the jit, or the executable of its signature); its caches and tokens kept."""
        state = self.state
        with state.mesh_context():
            args = self._args(self._set_table(inputs))
            out, state.kv_caches, self._prev_tokens = self.programs.call(name, self._jits[name], args)
        return out

    def _args(self, inputs: StepInputs[HostOrDevice], abstract: Any = None) -> tuple[Any, ...]:
        """A program's arguments: the parameters, caches, sampled tokens and page table (or
        `abstract` copies of them: background.py), with `inputs`."""
        state = abstract or (self.state.params, self.state.kv_caches, self._prev_tokens, self.page_table.array)
        return state[0], state[1], inputs, state[2], state[3]

    def _set_table(self, inputs: StepInputs[HostOrDevice]) -> StepInputs[HostOrDevice]:
        """Sets the page-table entries the (placed) inputs carry; the inputs without them."""
        if inputs.table is not None:
            self.page_table.apply(inputs.table)
        return dataclasses.replace(inputs, table=None)

    def load_adapter(self, slot: int, adapter: Adapter | None) -> None:
        """A LoRA adapter written into device slot `slot` on the launcher (after the steps
        submitted before, before those submitted after); DeviceState.lora_writer compiled its
        one write at start-up."""
        writer = self.state.lora_writer
        if writer is None:
            raise ValueError("LoRA adapters need enable_lora=True")
        self.launcher.submit(writer.write, slot, adapter)

    def trace(self, inputs: StepInputs[np.ndarray], num_steps: int = 1, greedy: bool = True) -> jax.stages.Traced:
        """The step traced as `dispatch` would run it (to read its jaxpr, or compile ahead; the
        step does not run, the page-table entries the inputs carry are set)."""
        name, placed = self._prepared(inputs, num_steps, greedy)
        with self.state.mesh_context():  # the table entries are set: the host's mirror has them
            return self._jits[name].trace(*self._args(self._set_table(placed)))

    def lower(self, inputs: StepInputs[np.ndarray], num_steps: int = 1, greedy: bool = True) -> jax.stages.Lowered:
        """The step lowered for these inputs' shapes (to read its HLO, or compile ahead)."""
        with self.state.mesh_context():
            return self.trace(inputs, num_steps, greedy).lower()

    def _variant(self, num_steps: int) -> str:
        if num_steps not in (1, self.num_decode_steps):
            raise ValueError(f"num_steps={num_steps}: this step compiles windows of {self.num_decode_steps} steps")
        return "step" if num_steps == 1 else "window"

    def _placed(self, inputs: StepInputs[np.ndarray]) -> StepInputs[HostOrDevice]:
        """Host inputs on the mesh (each array split or replicated as the step expects), the
        sampling defaults that were not sent filled on the device."""
        placed: StepInputs[HostOrDevice] = inputs
        if self.mesh is not None:
            placed = put_inputs(inputs, input_shardings(self.mesh, inputs, self.num_replicas > 1))
        return dataclasses.replace(placed, sampling=self._defaults.fill(placed.sampling))

    def warm_up(self, background: bool = False) -> float:
        """Compiles every (bucket, penalty history, prompt logprobs) variant, the step's on a
        pool of threads (warm_up.py), and runs each once where that is needed (`_ready`);
        returns seconds. With `background`, a first request's buckets before it returns and the
        rest on a thread (background.py: `ready_buckets` grow as they come in)."""
        start = time.perf_counter()
        for width in self.inputs.update_widths:  # the page-table scatter of each width
            with self.state.mesh_context():
                self._set_table(self._placed(self.padding_inputs(self.buckets[0], False, table_width=width)))
        variants = step_variants(self)
        if background:
            ready, rest = serving_order(groups(variants))
            first = [variant for _, group in ready for variant in group]
            self._ready(first)
            self.split_buckets = ()  # its halves compile by running: only the engine's thread may run steps
            state = (self.state.params, self.state.kv_caches, self._prev_tokens, self.page_table.array)
            abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.format), state)
            buckets = [bucket for bucket, _ in ready if bucket is not None]
            self.background = BackgroundCompile(rest, lambda g: self._ready(g, abstract), buckets, len(first))
        else:
            self._ready(variants)
        for t_bucket in self.split_buckets:
            inputs = self.padding_inputs(t_bucket, False)
            self.fetch(self.dispatch_sample(self.dispatch_forward(inputs), inputs))
        elapsed = time.perf_counter() - start
        logger.info("compiled %d step variants in %.1fs", self.num_compiled(), elapsed)
        return elapsed

    def _ready(self, variants: list[tuple[StepInputs[np.ndarray], int, bool]], abstract: Any = None) -> None:
        """The variants read from the store or compiled (programs.py), each traced against the
        real parameters and caches, or (background) `abstract` copies of them. Each runs once
        on the engine's thread: on an accelerator its first run loads its kernels; through the
        jit (no store) it enters the jit's dispatch cache. Read from the store on the CPU, or
        compiled in the background, none runs (the 512-token buckets' runs cost seconds)."""
        platform = self.state.local_device.platform
        prepared = [self._prepared(inputs, num_steps, greedy) for inputs, num_steps, greedy in variants]
        with self.state.mesh_context():
            entries = [(name, self._jits[name], self._args(self._set_table(p), abstract)) for name, p in prepared]
        threads = compile_threads(len(entries), platform)
        if abstract is not None:  # a core left to the steps that run meanwhile
            threads = max(1, min(threads, (os.cpu_count() or 1) - 1))
        self.programs.ensure(entries, lambda lowered: compile_all(lowered, platform, threads), threads)
        if abstract is None and (platform != "cpu" or self.programs.store is None):
            for inputs, num_steps, greedy in variants:
                self.execute(inputs, num_steps, greedy)

    @property
    def ready_tokens(self) -> int:
        """The largest token bucket whose variants are all ready (background.py)."""
        return self.buckets[-1] if self.background is None else self.background.ready_tokens

    @property
    def complete(self) -> bool:
        """Every variant ready: decode windows and greedy twins may run."""
        return self.background is None or self.background.complete

    def token_seconds(self) -> float:
        """A full bucket's seconds per token, run once (compiled already): what recomputing costs."""
        start = time.perf_counter()
        self.execute(self.padding_inputs(self.buckets[-1], False))
        return (time.perf_counter() - start) / self.buckets[-1]

    def num_compiled(self) -> int:
        """Compiled variants of the step so far (a test asserts it stays put after warm-up)."""
        writer, jits = self.state.lora_writer, (self._step, self._window, self._forward, self._sample)
        own = sum(f._cache_size() for f in jits)  # type: ignore[attr-defined]  # jit's count; not in jax's stubs
        return self.page_table.num_compiled() + (writer.num_compiled() if writer else 0) + own
