"""ModelRunner: owns the parameters and the KV cache and runs the one jitted step.

Data flow of a step:
    SchedulerPlan --prepare (inputs.InputBuilder)--> StepInputs (numpy, padded to a token bucket
    T and its sequence bucket S) --execute--> ONE jitted call: forward over the ragged batch (each layer writes its
    new K/V into the paged cache and attends) -> logits of each sequence's last token -> in-jit
    sampling -> int32 tokens and logprobs back to the host.

`dispatch` returns the step's outputs still on the device, so the engine can plan and dispatch the
next step before they arrive (async scheduling): each step also hands the next one its sampled
tokens (padded to the largest sequence bucket, so no new variants), which fill the next step's
placeholder input ids inside the jit (StepInputs.prev_rows). `execute` is dispatch + fetch.
With the launcher's thread (EngineConfig.dispatch_thread, launcher.py) a dispatch hands the
jitted call to that thread and returns a Future of its outputs; `fetch` waits for both.

Every bucket is compiled in `warm_up`; JAX's persistent compilation cache makes later start-ups
cheap. The KV cache is donated to the step, so each layer's pages are updated in place, and
allocated in a pinned row-major layout that every jit hands back (kv_pool, pallas_kernels.kv_layout:
XLA:TPU would otherwise relay a head_dim-64 cache around the kernels every step). Padding
rows write nowhere (their K/V writes are dropped by the kernel) and their page-table rows point at
the null page 0, which no sequence owns. The block tables stay on the device
(page_table.py): a step sends only the entries that changed, set in place before it runs.

On a mesh (EngineConfig.mesh) the parameters are split by the logical-axis rules of `sharding`,
each layer's cache by KV heads over `tensor`, the step's token ids and positions over `sequence`,
and the step is traced under `jax.set_mesh` so attention runs per shard. With `data` > 1 there
are that many independent replicas: caches and step inputs get a leading [data] axis (one
scheduler per replica fills its row) and the step is vmapped over it with
`spmd_axis_name="data"`, so all replicas run in the one jitted call. Sampled tokens come back
replicated to every device (and every host).
"""
from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import Future

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from jaxinfer.config import EngineConfig
from jaxinfer.core.plan import SchedulerPlan
from jaxinfer.worker.host_memory import reuse_freed_heap
from jaxinfer.worker.inputs import InputBuilder, StepInputs
from jaxinfer.worker.kv_calibration import calibrated_caches
from jaxinfer.worker.kv_pool import cache_struct, plan_num_pages, zeroed_caches
from jaxinfer.worker.launcher import Launcher, dispatch_thread_enabled, landed
from jaxinfer.loader import LoadedModel
from jaxinfer.worker.page_table import DevicePageTable
from jaxinfer.quant.kv_cache import QuantizedKVCache, is_quantized_kv, resolve_kv_dtype
from jaxinfer.sampling.arrays import fill_defaults
from jaxinfer.sampling.device_defaults import DeviceDefaults
from jaxinfer.sampling.sampler import SamplerOutput
from jaxinfer.worker.step_variants import (as_greedy, decode_sized_buckets, decode_steps, greedy_variant_enabled,
                                    input_shardings, split_step_enabled, step_jits, window_compiler_options)
from jaxinfer.worker.warm_up import compile_all, step_variants
from sharding import (DATA, SEQUENCE, axis_size, head_layout, kv_cache_spec, make_mesh, pin_weight_layouts,
                      replicated_spec, shard_params)
from sharding.experts import check_expert_axis
from sharding.multihost import broadcast_int, fetch, put_inputs

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: LoadedModel, engine: EngineConfig, max_model_len: int):
        engine = engine.with_page_size(max_model_len)
        self.model, self.config, self.engine = model, model.config, engine
        self.family = model.family
        self.max_model_len = max_model_len
        self.pages_per_seq = -(-max_model_len // engine.cache.page_size)
        self.mesh = make_mesh(engine.parallel.mesh) if engine.parallel.mesh is not None else None
        check_expert_axis(self.mesh, self.config.num_experts)
        self.layout = head_layout(self.mesh, self.config.num_heads, self.config.num_kv_heads)
        self.num_replicas = axis_size(self.mesh, DATA)
        self.params = self._place_params(model)
        self.kv_dtype = resolve_kv_dtype(engine.cache.kv_cache_dtype, model.params.embed.dtype)
        # Every host must allocate the same pool: process 0's number wins.
        self.num_pages = broadcast_int(
            plan_num_pages(self.config, engine, self.kv_dtype, self.layout.kv_heads_per_device,
                           self.local_device))
        self.kv_caches = self._allocate_kv_caches()
        if engine.compile.cpu_heap_reuse and jax.default_backend() == "cpu":  # after loading's transients
            reuse_freed_heap()
        # Token buckets split evenly over the sequence axis.
        sp = axis_size(self.mesh, SEQUENCE)
        self.buckets = tuple(sorted({-(-b // sp) * sp for b in engine.buckets()}))
        self.inputs = InputBuilder(engine, self.buckets, pages_per_seq=self.pages_per_seq,
                                   max_model_len=max_model_len, vocab_size=self.config.vocab_size,
                                   num_replicas=self.num_replicas, num_speculative_tokens=(
                                       engine.speculative_config.num_speculative_tokens
                                       if engine.speculative_config is not None else 0))
        max_seqs = engine.seq_bucket(self.buckets[-1])  # the sampled-token width handed on
        prev_shape = (max_seqs,) if self.num_replicas == 1 else (self.num_replicas, max_seqs)
        # Every array the step carries over (KV caches, sampled tokens) is committed to the
        # params' device(s) from the start: an uncommitted first value would give the step a
        # second signature (and a compile after warm-up) once its committed outputs come back.
        # The caches come back in their own formats: placement and pinned row-major layout.
        formats = jax.tree.map(lambda c: c.format, self.kv_caches)
        out_shardings, home = (None, formats, None), self._home
        if self.mesh is not None:
            home = NamedSharding(self.mesh, P())  # replicated
            out_shardings = (home, formats, home)
        self._prev_tokens = jax.device_put(jnp.zeros(prev_shape, jnp.int32), home)
        # The sequences' block tables stay on the device, shaped like the builder's host mirror; a
        # step sends only the entries that changed.
        self.page_table = DevicePageTable(*self.inputs.tables[0].rows.shape, home, self.num_replicas, DATA)
        self._defaults = DeviceDefaults(self.config.vocab_size, home, self.mesh, self.num_replicas)
        # Decode windows (EngineConfig.num_decode_steps): one variant per decode-sized bucket.
        self.num_decode_steps = decode_steps(engine.scheduler.num_decode_steps, self.num_replicas)
        self._step, self._window, self._forward, self._sample = step_jits(
            self.family, self.config, engine.compile.attn_impl, max_seqs, self.num_replicas, self.num_decode_steps,
            out_shardings, window_compiler_options() if self.num_decode_steps > 1 else None)
        decode_sized = decode_sized_buckets(self.inputs, self.buckets, engine.scheduler.max_num_seqs)
        self.window_buckets = decode_sized if self.num_decode_steps > 1 else ()
        # The step split in two (structured output: masks filled while the forward runs).
        self.split_buckets = decode_sized if split_step_enabled(
            engine.compile.structured_output_overlap, self.num_replicas) else ()
        # The greedy twin of each decode-sized bucket's decode step: its window, if windows run.
        self.greedy_buckets = decode_sized if greedy_variant_enabled(engine.compile.greedy_variant, self.num_replicas) else ()
        self.greedy_steps = self.num_decode_steps
        self.launcher = Launcher(dispatch_thread_enabled(engine.compile.dispatch_thread))

    def _place_params(self, model: LoadedModel):
        """The parameters as the step computes with them: the family's layout, placed on the mesh,
        fused weights pinned to their matmuls' layout on a TPU. The model is left holding one copy
        of each weight."""
        if self.family.compute_layout is not None:
            model.params = self.family.compute_layout(model.params, self.mesh)
        placed = model.params if self.mesh is None else shard_params(
            model.params, self.family.param_axes, self.mesh, self.layout)
        params = pin_weight_layouts(placed, self.family.param_axes)
        if any(a is not b for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(params), strict=True)):
            model.params = params  # relaid on a TPU
        return params

    def _allocate_kv_caches(self) -> tuple[jax.Array | QuantizedKVCache, ...]:
        sharding = self._home
        if self.mesh is not None:
            sharding = NamedSharding(self.mesh, kv_cache_spec(self.mesh, replicas=self.num_replicas > 1))
        caches = zeroed_caches(cache_struct(self.num_pages, self.engine.cache.page_size, self.layout.cache_kv_heads,
                                            self.config.head_dim, self.kv_dtype, sharding, self.num_replicas),
                               self.config.num_layers)
        if is_quantized_kv(self.kv_dtype):  # int8 / fp8: per-head scales calibrated here
            caches = calibrated_caches(caches, self.model, self.params, self.layout.cache_kv_heads,
                                       self.engine.compile.attn_impl, self.mesh)
        return caches

    @property
    def _home(self) -> SingleDeviceSharding:
        """The device of a model without a mesh: where its embedding table is."""
        return SingleDeviceSharding(next(iter(self.params.embed.devices())))

    @property
    def local_device(self):
        """A device of this process holding the model: its platform and memory plan the pool."""
        return jax.tree.leaves(self.params.embed)[0].addressable_shards[0].device

    def _mesh_context(self):
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    @property
    def kv_cache_bytes(self) -> int:
        return sum(c.nbytes for c in jax.tree.leaves(self.kv_caches))

    def prepare(self, plan: SchedulerPlan | list[SchedulerPlan],
                previous: list[SchedulerPlan] | None = None, masks: bool = True) -> StepInputs:
        """Padded numpy inputs of one step (one plan per data replica); `previous`: the plans of
        the step in flight, whose sampled tokens the placeholders of this one stand for;
        `masks=False` leaves grammar rows' allowed bits for `inputs.fill_masks` (split step)."""
        return self.inputs.prepare(plan, previous, masks)

    def padding_inputs(self, t_bucket: int, with_history: bool, spec: bool = False,
                       prompt: bool = False, table_width: int = 0) -> StepInputs:
        """All-padding inputs of one bucket: the step writes nothing and reads the null page."""
        return self.inputs.padding_inputs(t_bucket, with_history, spec, prompt, table_width)

    def execute(self, inputs: StepInputs, num_steps: int = 1, greedy: bool = True) -> SamplerOutput:
        """Runs the step and waits for it. Returns numpy outputs (with a leading [data] axis when
        there are several replicas; a decode window's have a leading [num_steps] axis)."""
        return self.fetch(self.dispatch(inputs, num_steps, greedy))

    @staticmethod
    def fetch(out: SamplerOutput | Future) -> SamplerOutput:
        """A dispatch's outputs as numpy, once its launch has returned and the device is done."""
        return fetch(landed(out))

    def dispatch(self, inputs: StepInputs, num_steps: int = 1, greedy: bool = True) -> SamplerOutput | Future:
        """Starts the step (num_steps > 1: the decode window of a decode-only plan); the KV cache
        is donated and replaced. Returns the outputs on the device (ready once it is done), or
        with the launcher's thread on, a Future of them (launcher.landed). Inputs that qualify
        run the greedy twin (`greedy_buckets`) unless `greedy` is False."""
        return self.launcher.submit(self._launch, *self._prepared(inputs, num_steps, greedy))

    def _prepared(self, inputs: StepInputs, num_steps: int, greedy: bool) -> tuple:
        """The jitted variant and its placed inputs (the greedy twin's where they qualify)."""
        buckets = self.greedy_buckets if greedy else ()
        return self._variant(num_steps), self._placed(as_greedy(inputs, num_steps, buckets, self.greedy_steps))

    def _launch(self, fn, inputs: StepInputs) -> SamplerOutput:
        """On the launcher: the page-table entries set, then the step; its caches and tokens kept."""
        with self._mesh_context():
            inputs = self._set_table(inputs)
            out, self.kv_caches, self._prev_tokens = fn(self.params, self.kv_caches, inputs,
                                                        self._prev_tokens, self.page_table.array)
        return out

    def _set_table(self, inputs: StepInputs) -> StepInputs:
        """Sets the page-table entries the (placed) inputs carry; the inputs without them."""
        if inputs.table is not None:
            self.page_table.apply(inputs.table)
        return inputs.replace(table=None)

    def dispatch_forward(self, inputs: StepInputs) -> jax.Array | Future:
        """The first half of a split step (a bucket in `split_buckets`): the forward, K/V
        written. Returns the last tokens' hidden rows on the device, for `dispatch_sample`."""
        def launch(inputs):
            with self._mesh_context():
                inputs = self._set_table(inputs)
                hidden, self.kv_caches = self._forward(self.params, self.kv_caches, inputs, self._prev_tokens,
                                                       self.page_table.array)
            return hidden
        return self.launcher.submit(launch, self._placed(inputs.replace(sampling=None)))

    def dispatch_sample(self, hidden: jax.Array | Future, inputs: StepInputs) -> SamplerOutput | Future:
        """The second half: LM head and sampling with `inputs.sampling` as it is now (its
        allowed-token bits may have been filled after `dispatch_forward`)."""
        def launch(sampling):
            with self._mesh_context():
                out, self._prev_tokens = self._sample(self.params, landed(hidden), sampling)
            return out
        return self.launcher.submit(launch, self._defaults.fill(inputs.sampling if self.mesh is None else put_inputs(
            inputs.sampling, self._input_shardings(inputs).sampling)))

    def trace(self, inputs: StepInputs, num_steps: int = 1, greedy: bool = True) -> jax.stages.Traced:
        """The step traced as `dispatch` would run it (to read its jaxpr, or compile ahead; the
        step does not run, the page-table entries the inputs carry are set)."""
        fn, inputs = self._prepared(inputs, num_steps, greedy)
        with self._mesh_context():  # the table entries are set: the host's mirror has them
            inputs = self._set_table(inputs)
            return fn.trace(self.params, self.kv_caches, inputs, self._prev_tokens, self.page_table.array)

    def lower(self, inputs: StepInputs, num_steps: int = 1, greedy: bool = True) -> jax.stages.Lowered:
        """The step lowered for these inputs' shapes (to read its HLO, or compile ahead)."""
        with self._mesh_context():
            return self.trace(inputs, num_steps, greedy).lower()

    def _variant(self, num_steps: int):
        if num_steps not in (1, self.num_decode_steps):
            raise ValueError(f"num_steps={num_steps}: this runner compiles windows of "
                             f"{self.num_decode_steps} steps")
        return self._step if num_steps == 1 else self._window

    def _placed(self, inputs: StepInputs) -> StepInputs:
        """Host inputs on the mesh (each array split or replicated as the step expects), the
        sampling defaults that were not sent filled on the device."""
        if self.mesh is not None:
            inputs = put_inputs(inputs, self._input_shardings(inputs))
        return inputs.replace(sampling=self._defaults.fill(inputs.sampling))

    def for_followers(self, inputs: StepInputs) -> tuple:
        """What StepChannel.send sends the other processes: the inputs with every sampling default
        filled (their template has them), then the header: token bucket, penalty history, prompt
        rows, page-table entries."""
        inputs = inputs.replace(sampling=fill_defaults(inputs.sampling, self.config.vocab_size))
        return (inputs, inputs.token_ids.shape[-1], inputs.sampling.history is not None,
                inputs.prompt is not None, 0 if inputs.table is None else inputs.table.slots.shape[-1])

    def _input_shardings(self, inputs: StepInputs):
        return input_shardings(self.mesh, inputs, self.num_replicas > 1)

    def warm_up(self) -> float:
        """Compiles every (bucket, penalty history, prompt logprobs) variant, the step's on a
        pool of threads (warm_up.py), and runs each once; returns seconds."""
        start = time.perf_counter()
        for width in self.inputs.update_widths:  # the page-table scatter of each width
            with self._mesh_context():
                self._set_table(self._placed(self.padding_inputs(self.buckets[0], False, table_width=width)))
        variants = step_variants(self)
        compile_all([self.lower(inputs, num_steps, greedy) for inputs, num_steps, greedy in variants],
                    self.local_device.platform)
        for inputs, num_steps, greedy in variants:
            self.execute(inputs, num_steps, greedy)
        for t_bucket in self.split_buckets:
            inputs = self.padding_inputs(t_bucket, False)
            self.fetch(self.dispatch_sample(self.dispatch_forward(inputs), inputs))
        elapsed = time.perf_counter() - start
        logger.info("compiled %d step variants in %.1fs", self.num_compiled(), elapsed)
        return elapsed

    def num_compiled(self) -> int:
        """Compiled variants of the step so far (a test asserts it stays put after warm-up)."""
        return self.page_table.num_compiled() + sum(
            f._cache_size() for f in (self._step, self._window, self._forward, self._sample))
