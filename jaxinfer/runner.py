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

Every bucket is compiled in `warm_up`; JAX's persistent compilation cache makes later start-ups
cheap. The KV cache is donated to the step, so each layer's pages are updated in place, and
allocated in a pinned row-major layout that every jit hands back (kv_pool, pallas_kernels.kv_layout:
XLA:TPU would otherwise relay a head_dim-64 cache around the kernels every step). Padding
rows write nowhere (their K/V writes are dropped by the kernel) and their page-table rows point at
the null page 0, which no sequence owns.

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
import functools
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from jaxinfer.config import EngineConfig
from jaxinfer.core.plan import SchedulerPlan
from jaxinfer.host_memory import reuse_freed_heap
from jaxinfer.inputs import InputBuilder, StepInputs
from jaxinfer.kv_calibration import calibrated_caches
from jaxinfer.kv_pool import cache_struct, plan_num_pages, zeroed_caches
from jaxinfer.loader import LoadedModel
from jaxinfer.quant.kv_cache import QuantizedKVCache, is_quantized_kv, resolve_kv_dtype
from jaxinfer.sampling.sampler import SamplerOutput
from jaxinfer.step import decode_window, forward_part, sample_part, step
from sharding import (DATA, SEQUENCE, axis_size, head_layout, is_multiprocess, kv_cache_spec, make_mesh,
                      replicated_spec, shard_params, tokens_spec)
from sharding.experts import check_expert_axis
from sharding.multihost import broadcast_int, fetch, put_inputs

logger = logging.getLogger(__name__)
DEFAULT_DECODE_STEPS = 8


def enable_compilation_cache(directory: str | None) -> None:
    if not directory:
        return
    path = Path(directory).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


class ModelRunner:
    def __init__(self, model: LoadedModel, engine: EngineConfig, max_model_len: int):
        engine = engine.with_page_size(max_model_len)
        self.model, self.config, self.engine = model, model.config, engine
        self.family = model.family
        self.max_model_len = max_model_len
        self.pages_per_seq = -(-max_model_len // engine.page_size)
        self.mesh = make_mesh(engine.mesh) if engine.mesh is not None else None
        check_expert_axis(self.mesh, self.config.num_experts)
        self.layout = head_layout(self.mesh, self.config.num_heads, self.config.num_kv_heads)
        self.num_replicas = axis_size(self.mesh, DATA)
        if self.family.compute_layout is not None:  # kept on the model: one copy of the weights
            model.params = self.family.compute_layout(model.params, self.mesh)
        self.params = model.params if self.mesh is None else shard_params(
            model.params, self.family.param_axes, self.mesh, self.layout)
        self.kv_dtype = resolve_kv_dtype(engine.kv_cache_dtype, model.params.embed.dtype)
        # Every host must allocate the same pool: process 0's number wins.
        self.num_pages = broadcast_int(
            plan_num_pages(self.config, engine, self.kv_dtype, self.layout.kv_heads_per_device,
                           self.local_device))
        self.kv_caches = self._allocate_kv_caches()
        if engine.cpu_heap_reuse and jax.default_backend() == "cpu":  # after loading's transients
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
        out_shardings, self._prev_tokens = (None, formats, None), jnp.zeros(prev_shape, jnp.int32)
        if self.mesh is None:
            self._prev_tokens = jax.device_put(self._prev_tokens, self._home)
        else:
            replicated = NamedSharding(self.mesh, P())
            out_shardings = (replicated, formats, replicated)
            self._prev_tokens = jax.device_put(self._prev_tokens, replicated)
        # Decode windows (EngineConfig.num_decode_steps): one variant per decode-sized bucket.
        self.num_decode_steps = decode_steps(engine.num_decode_steps, self.num_replicas)
        self._step, self._window, self._forward, self._sample = step_jits(
            self.family, self.config, engine.attn_impl, max_seqs, self.num_replicas, self.num_decode_steps,
            out_shardings)
        decode_sized = decode_sized_buckets(self.inputs, self.buckets, engine.max_num_seqs)
        self.window_buckets = decode_sized if self.num_decode_steps > 1 else ()
        # The step split in two (structured output: masks filled while the forward runs).
        self.split_buckets = decode_sized if split_step_enabled(
            engine.structured_output_overlap, self.num_replicas) else ()

    def _allocate_kv_caches(self) -> tuple[jax.Array | QuantizedKVCache, ...]:
        sharding = self._home
        if self.mesh is not None:
            sharding = NamedSharding(self.mesh, kv_cache_spec(self.mesh, replicas=self.num_replicas > 1))
        caches = zeroed_caches(cache_struct(self.num_pages, self.engine.page_size, self.layout.cache_kv_heads,
                                            self.config.head_dim, self.kv_dtype, sharding, self.num_replicas),
                               self.config.num_layers)
        if is_quantized_kv(self.kv_dtype):  # int8 / fp8: per-head scales calibrated here
            caches = calibrated_caches(caches, self.model, self.params, self.layout.cache_kv_heads,
                                       self.engine.attn_impl, self.mesh)
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
                       prompt: bool = False) -> StepInputs:
        """All-padding inputs of one bucket: the step writes nothing and reads the null page."""
        return self.inputs.padding_inputs(t_bucket, with_history, spec, prompt)

    def execute(self, inputs: StepInputs, num_steps: int = 1) -> SamplerOutput:
        """Runs the step and waits for it. Returns numpy outputs (with a leading [data] axis when
        there are several replicas; a decode window's have a leading [num_steps] axis)."""
        return fetch(self.dispatch(inputs, num_steps))

    def dispatch(self, inputs: StepInputs, num_steps: int = 1) -> SamplerOutput:
        """Starts the step (num_steps > 1: the decode window of a decode-only plan); the KV cache
        is donated and replaced. Returns the outputs on the device (ready once it is done)."""
        fn = self._variant(num_steps)
        inputs = self._placed(inputs)
        with self._mesh_context():
            out, self.kv_caches, self._prev_tokens = fn(self.params, self.kv_caches, inputs,
                                                        self._prev_tokens)
        return out

    def dispatch_forward(self, inputs: StepInputs) -> jax.Array:
        """The first half of a split step (a bucket in `split_buckets`): the forward, K/V
        written. Returns the last tokens' hidden rows on the device, for `dispatch_sample`."""
        inputs = self._placed(inputs.replace(sampling=None))
        with self._mesh_context():
            hidden, self.kv_caches = self._forward(self.params, self.kv_caches, inputs, self._prev_tokens)
        return hidden

    def dispatch_sample(self, hidden: jax.Array, inputs: StepInputs) -> SamplerOutput:
        """The second half: LM head and sampling with `inputs.sampling` as it is now (its
        allowed-token bits may have been filled after `dispatch_forward`)."""
        sampling = inputs.sampling if self.mesh is None else put_inputs(
            inputs.sampling, self._input_shardings(inputs).sampling)
        with self._mesh_context():
            out, self._prev_tokens = self._sample(self.params, hidden, sampling)
        return out

    def trace(self, inputs: StepInputs, num_steps: int = 1) -> jax.stages.Traced:
        """The step traced for these inputs' shapes (to read its jaxpr; nothing runs)."""
        fn, inputs = self._variant(num_steps), self._placed(inputs)
        with self._mesh_context():
            return fn.trace(self.params, self.kv_caches, inputs, self._prev_tokens)

    def lower(self, inputs: StepInputs, num_steps: int = 1) -> jax.stages.Lowered:
        """The step lowered for these inputs' shapes (to read its HLO; nothing runs)."""
        with self._mesh_context():
            return self.trace(inputs, num_steps).lower()

    def _variant(self, num_steps: int):
        if num_steps == 1:
            return self._step
        if num_steps != self.num_decode_steps:
            raise ValueError(f"num_steps={num_steps}: this runner compiles windows of "
                             f"{self.num_decode_steps} steps")
        return self._window

    def _placed(self, inputs: StepInputs) -> StepInputs:
        """Host inputs on the mesh (each array split or replicated as the step expects)."""
        return inputs if self.mesh is None else put_inputs(inputs, self._input_shardings(inputs))

    def _input_shardings(self, inputs: StepInputs):
        return input_shardings(self.mesh, inputs, self.num_replicas > 1)

    def warm_up(self) -> float:
        """Compiles every (bucket, penalty history, prompt logprobs) variant; returns seconds."""
        start = time.perf_counter()
        for t_bucket in self.buckets:
            for with_history in (False, True) if self.engine.penalties else (False,):
                for prompt in (False, True) if self.engine.enable_prompt_logprobs else (False,):
                    self.execute(self.padding_inputs(t_bucket, with_history, prompt=prompt))
            if self.inputs.num_speculative_tokens:  # the verify variant (speculative decoding)
                self.execute(self.padding_inputs(t_bucket, False, spec=True))
        for t_bucket in self.window_buckets:
            self.execute(self.padding_inputs(t_bucket, False), self.num_decode_steps)
        for t_bucket in self.split_buckets:
            inputs = self.padding_inputs(t_bucket, False)
            fetch(self.dispatch_sample(self.dispatch_forward(inputs), inputs))
        elapsed = time.perf_counter() - start
        logger.info("compiled %d step variants in %.1fs", self.num_compiled(), elapsed)
        return elapsed

    def num_compiled(self) -> int:
        """Compiled variants of the step so far (a test asserts it stays put after warm-up)."""
        return sum(f._cache_size() for f in (self._step, self._window, self._forward, self._sample))


def step_jits(family, config, attn_impl: str, max_seqs: int, num_replicas: int, num_decode_steps: int,
              out_shardings) -> tuple:
    """The runner's jitted functions: the step and the decode window, fn(params, caches, inputs,
    prev_tokens), vmapped over data replicas (`spmd_axis_name="data"`); the split step's forward
    and sampling halves. The caches are donated and come back as `out_shardings[1]` says."""
    parts = (family, config, attn_impl, max_seqs)
    jit_step = lambda fn: jax.jit(  # noqa: E731
        fn if num_replicas == 1 else jax.vmap(fn, in_axes=(None, 0, 0, 0), spmd_axis_name=DATA),
        donate_argnums=(1,), out_shardings=out_shardings)
    return (jit_step(functools.partial(step, *parts)),
            jit_step(functools.partial(decode_window, *parts, num_decode_steps)),
            jax.jit(functools.partial(forward_part, *parts[:3]), donate_argnums=(1,),
                    out_shardings=out_shardings[:2]),
            jax.jit(functools.partial(sample_part, family, max_seqs),
                    out_shardings=(out_shardings[0], out_shardings[2])))


def decode_sized_buckets(inputs: InputBuilder, buckets: tuple[int, ...], max_num_seqs: int) -> tuple[int, ...]:
    """The token buckets a decode-only plan can use (one token per sequence): where the decode
    window and the split step are compiled."""
    return tuple(b for b in buckets if b <= inputs.bucket_for(min(max_num_seqs, buckets[-1])))


def input_shardings(mesh, inputs: StepInputs, replicas: bool) -> StepInputs:
    """How the step takes its inputs on `mesh`: tokens split over the sequence axis, the rest
    replicated (per data replica with `replicas`); a tree like `inputs`."""
    tokens = NamedSharding(mesh, tokens_spec(mesh, replicas=replicas))
    other = NamedSharding(mesh, replicated_spec(replicas=replicas))
    return inputs.replace(
        token_ids=tokens, positions=tokens, prev_rows=tokens,
        meta=jax.tree.map(lambda _: other, inputs.meta),
        logits_indices=other, sampling=jax.tree.map(lambda _: other, inputs.sampling),
        spec=jax.tree.map(lambda _: other, inputs.spec),
        prompt=None if inputs.prompt is None else inputs.prompt.replace(targets=tokens, num_top=other))


def split_step_enabled(setting: bool | None, num_replicas: int = 1) -> bool:
    """Whether the split step is compiled (EngineConfig.structured_output_overlap): the setting,
    by default on accelerators only (on the CPU the host and the step share the same cores, so
    the overlap has nothing to gain); never with data replicas or several hosts."""
    if num_replicas > 1 or is_multiprocess():
        return False
    return jax.default_backend() != "cpu" if setting is None else setting


def decode_steps(setting: int | None, num_replicas: int = 1) -> int:
    """Steps per decode window: the setting, by default 8. Llama-3.2-1B shape on an H100 (bf16,
    128-token prompts), tokens/s at batch 1 / 16 / 64 / 256: single steps 247 / 5,005 / 9,130 /
    17,446; windows of 4: 378 / 9,623 / 14,843 / 30,580; of 8: 484 / 9,743 / 20,231 / 40,664.
    SmolLM2 float32 on a 2-core CPU: 8 steps 1.21x single steps at batch 1, 1.08x at batch 8.
    One step with data replicas or several hosts, whose plans and step channel carry single steps."""
    if num_replicas > 1 or is_multiprocess():
        return 1
    return DEFAULT_DECODE_STEPS if setting is None else setting
