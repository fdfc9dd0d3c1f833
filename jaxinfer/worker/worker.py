"""Worker: the engine's one door to the devices -- a plan in, a handle out, tokens when they land.

    worker = Worker(model, config, max_model_len)
    handle = worker.execute(plans, previous)   # inputs built, the step launched; returns at once
    ...                                        # the host plans the next step meanwhile
    out = handle.result()                      # numpy tokens (+ logprobs) once they land

It holds the DeviceState (parameters and KV caches, device_state.py) and the CompiledStep (the
jitted variants, their warm-up and launch, compiled_step.py). `previous` is the handle of the
step still in flight: its sampled tokens stand for this step's placeholders and never visit the
host on the way.

Structured output, overlapped (`overlaps_masks`): a grammar row's mask must follow the token
before it, which the host learns only when the previous step lands. `execute(...,
masks_later=True)` launches the forward alone (the split step, where the plan fits one of its
buckets); the engine lands the previous step and advances its matchers; then `handle.sample()`
fills the allowed-token bits and launches the LM head and sampling (or, where the split step does
not apply, the whole step).

Several hosts: process 0's worker sends each step's padded inputs to the others over a
StepChannel before launching; their workers run the same steps in `follow()`.

Pipeline stages with a batch in flight on each (`pipeline_stages` > 1, pipelined.py): each
`execute` is one tick; its plan (of one virtual replica, or none) enters the pipeline and the
handle it returns holds the batch that leaves it, whose tokens that call samples.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import jax
import numpy as np

from jaxinfer.config import EngineConfig
from jaxinfer.config.kv_layout import KVLayout
from jaxinfer.core.plan import SchedulerPlan
from jaxinfer.core.scheduler import Scheduler
from jaxinfer.kv import SwapCost
from jaxinfer.loader import LoadedModel
from jaxinfer.lora.peft import Adapter
from jaxinfer.worker.compiled_step import CompiledStep
from jaxinfer.worker.device_state import DeviceState
from jaxinfer.worker.inputs import InputBuilder
from jaxinfer.worker.kv_host import HostKV, host_slots
from jaxinfer.worker.page_copy import PageCopier
from jaxinfer.worker.pipelined import PipelinedStep, pipeline_stages
from jaxinfer.worker.step import StepOutput
from jaxinfer.worker.step_inputs import StepInputs
from jaxinfer.worker.step_variants import for_followers
from sharding import StepChannel
from sharding.multihost import SHUTDOWN, TRANSFER


class StepHandle:
    """A launched step: its plans (one per data replica) and its outputs once they land."""

    def __init__(
        self,
        plans: list[SchedulerPlan],
        out: StepOutput | Future[StepOutput] | None,
        step: CompiledStep,
        late: tuple[StepInputs[np.ndarray], jax.Array | Future[jax.Array] | None] | None = None,
        replicas: list[int] | None = None,
    ):
        self.plans = plans
        self.replicas = list(range(len(plans))) if replicas is None else replicas  # the replica of each plan
        self._out, self._step, self._late = out, step, late
        self._result: StepOutput | None = None

    @property
    def waits_for_masks(self) -> bool:
        return self._late is not None

    def sample(self) -> None:
        """Of a step launched with masks_later: fills its grammar rows' allowed-token bits (their
        matchers are now past the previous step's tokens) and launches the rest of the step."""
        if self._late is None:
            raise RuntimeError("sample(): this step was launched whole")
        inputs, hidden = self._late
        self._late = None
        InputBuilder.fill_masks(self.plans[0], inputs, device_busy=hidden is not None)
        self._out = self._step.dispatch_sample(hidden, inputs) if hidden is not None else self._step.dispatch(inputs)

    def result(self) -> StepOutput:
        """The step's outputs as numpy (waits for them once; a replica axis leads with data > 1)."""
        if self._result is None:
            if self._late is not None or self._out is None:
                raise RuntimeError("result(): sample() the step first (it was launched with masks_later)")
            self._result = self._step.fetch(self._out)
            self._out = None
        return self._result


class Worker:
    def __init__(
        self, model: LoadedModel, config: EngineConfig, max_model_len: int, channel: StepChannel | None = None
    ):
        self.state = DeviceState(model, config, max_model_len)
        self.pipeline_stages = stages = pipeline_stages(self.state, config)
        self.step = CompiledStep(self.state) if stages == 1 else PipelinedStep(self.state, stages)
        self._channel = channel
        self._copier: PageCopier | None = None  # compiled at warm-up (worker/page_copy.py)
        self._followed = 0  # background compilation's ready variants the schedulers were capped at
        self.host_pages = host_slots(self.state, config.cache.kv_offload_gb)
        self.host_kv = HostKV(self.state, self.host_pages, channel=channel) if self.host_pages else None  # kv_host.py
        # What swapping a preempted sequence's pages costs against recomputing them (kv/swap.py):
        # the host tier's calls timed now, the step's cost per token at warm-up.
        self.swap_cost = SwapCost(self.host_kv.transfer_seconds, self.host_kv.width) if self.host_kv else None

    # --- what the engine plans with -------------------------------------------------------------
    @property
    def num_replicas(self) -> int:
        return self.state.num_replicas

    @property
    def num_pages(self) -> int:
        """KV pages per replica (page 0 is the null page)."""
        return self.state.num_pages

    @property
    def page_size(self) -> int:
        return self.state.page_size

    @property
    def kv_pool(self) -> tuple[int, int, bool, KVLayout, int, SwapCost | None]:
        """What each replica's KV cache manager manages: pages, page size, prefix caching, the
        KV layout, the host tier's pages and the swap cost model (core/replica.py)."""
        cache = self.state.engine.cache
        pool = self.num_pages, self.page_size, cache.enable_prefix_caching, self.kv_layout, self.host_pages
        return (*pool, self.swap_cost)

    @property
    def kv_layout(self) -> KVLayout:
        """Which layers share which page table and cache (config/kv_layout.py)."""
        return self.state.kv_layout

    @property
    def num_decode_steps(self) -> int:
        """Steps in a decode window (1: none, or not compiled yet); the scheduler plans windows of this many."""
        return self.step.num_decode_steps if self.step.complete else 1

    @property
    def max_batched_tokens(self) -> int:
        """The largest token bucket: the most tokens one step can hold."""
        return self.step.buckets[-1]

    @property
    def overlaps_masks(self) -> bool:
        """Whether grammar masks can be filled while a step's forward runs (`execute(...,
        masks_later=True)` then splits the step)."""
        return bool(self.step.split_buckets)

    # --- the step --------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Whether a batch is in the pipeline still (ticks must run till it leaves; pipelined.py)."""
        return isinstance(self.step, PipelinedStep) and self.step.busy

    def execute(
        self,
        plans: list[SchedulerPlan],
        previous: StepHandle | None = None,
        *,
        masks_later: bool = False,
        replicas: list[int] | None = None,
    ) -> StepHandle:
        """Builds the plans' inputs (one plan per data replica) and launches the step; a plan of
        several steps runs as a decode window. With `masks_later` (one plan, `overlaps_masks`)
        the handle waits for `sample()` (module docstring). Pipelined: one plan or none, of
        virtual replica `replicas[0]`; the handle's are those of the batch that leaves."""
        prev = previous.plans if previous is not None else None
        if self.host_kv is not None and any(p.transfers for p in plans):  # the host tier's, first
            self.step.launcher.submit(self.host_kv.transfer, [p.transfers for p in plans])
        if any(p.page_copies for p in plans):  # forks' shared pages copied before the step writes
            self.step.launcher.submit(self.copier.copy, [p.page_copies for p in plans])
        if isinstance(self.step, PipelinedStep):
            inputs, (out_plans, out_replicas) = self.step.enter(plans[0] if plans else None, (replicas or [0])[0], prev)
            if self._channel is not None:  # the tick's stacked inputs: the other processes keep no ring
                self._channel.send(*for_followers(inputs, self.step.config.vocab_size))
            return StepHandle(out_plans, self.step.dispatch(inputs), self.step, replicas=out_replicas)
        plan = plans if len(plans) > 1 else plans[0]
        if masks_later and len(plans) == 1 and plans[0].num_steps == 1:
            return self._execute_late(plans[0], prev)
        inputs = self.step.prepare(plan, prev)
        if self._channel is not None:
            self._channel.send(*for_followers(inputs, self.step.config.vocab_size))
        return StepHandle(plans, self.step.dispatch(inputs, plans[0].num_steps), self.step)

    def _execute_late(self, plan: SchedulerPlan, previous: list[SchedulerPlan] | None) -> StepHandle:
        inputs = self.step.prepare(plan, previous, masks=False)
        split = (
            plan.num_batched_tokens <= self.step.split_buckets[-1]  # else the fused step, later
            and inputs.sampled().history is None
            and inputs.prompt is None
        )
        hidden = self.step.dispatch_forward(inputs) if split else None
        return StepHandle([plan], None, self.step, late=(inputs, hidden))

    def load_adapter(self, slot: int, adapter: Adapter | None) -> None:
        """Writes a LoRA adapter into device slot `slot`, in order with the steps launched."""
        self.step.load_adapter(slot, adapter)

    def warm_up(self, background: bool = False) -> float:
        """Compiles (and runs once) every variant of the step and the page copy; returns seconds.
        `background`: a first request's buckets now, the rest on a thread (background.py), followed
        by `follow_compiles`."""
        start = time.perf_counter()
        self.copier.num_compiled()
        seconds = self.step.warm_up(background) + time.perf_counter() - start
        if self.swap_cost is not None and self.step.complete:  # timed only where a host tier can swap
            self.swap_cost.token_s = self.step.token_seconds()
        return seconds

    def follow_compiles(self, schedulers: list[Scheduler]) -> None:
        """Between steps, on the engine's thread, while variants compile in the background: each
        scheduler's token budget and batch capped at the largest ready bucket (larger batches
        wait for theirs) and each step padded to the smallest ready bucket holding it; once all
        are ready, the configured limits back and the host tier's swap cost timed (it runs the
        largest bucket)."""
        step = self.step
        if step.background is None or self._followed == step.background.num_ready:
            return
        self._followed = step.background.num_ready
        limits, cap = self.state.engine.scheduler, step.ready_tokens
        step.inputs.ready = None if step.complete else step.background.ready_buckets  # steps padded to these
        for scheduler in schedulers:
            scheduler.max_num_batched_tokens = limits.max_num_batched_tokens if step.complete else cap
            scheduler.max_num_seqs = min(limits.max_num_seqs, limits.max_num_batched_tokens if step.complete else cap)
        if step.complete and self.swap_cost is not None:
            self.swap_cost.token_s = step.token_seconds()

    def compile_stats(self) -> dict[str, int]:
        """Compiled variants so far; the step's variants ready and in all (compile_progress)."""
        ready, total = self.compile_progress()
        return {"compiled_variants": self.num_compiled(), "step_variants_ready": ready, "step_variants_total": total}

    def pipeline_stats(self) -> dict[str, float]:
        """With a batch in flight on every pipeline stage: ticks run and how full the stages were."""
        return self.step.stats() if isinstance(self.step, PipelinedStep) else {}

    def compile_progress(self) -> tuple[int, int]:
        """(step variants ready, in all): background compilation's, else the warm-up's (or, without
        one, those compiled as steps first needed them) twice."""
        background = self.step.background
        if background is not None:
            return background.num_ready, background.total
        ready = len(self.step.programs.records)
        return ready, ready

    @property
    def copier(self) -> PageCopier:
        if self._copier is None:
            self._copier = PageCopier(self.state, self.state.engine.scheduler.max_num_seqs)
        return self._copier

    def num_compiled(self) -> int:
        """Variants of the step compiled so far (the page copy's count is its own: PageCopier)."""
        return self.step.num_compiled()

    # --- several hosts ------------------------------------------------------------------------------
    def follow(self) -> bool:
        """On processes other than 0: runs process 0's steps until it releases this process.
        False when process 0 shut the followers down (no more steps will come)."""
        if self._channel is None:
            raise RuntimeError("follow() is for processes other than 0 of a multi-host engine")
        step, host = self.step, self.host_kv
        while True:
            command, inputs = self._channel.receive(
                lambda bucket, history, prompt, table_width: step.padding_inputs(
                    bucket, history, False, prompt, table_width
                ),
                host.id_template if host is not None else None,
            )
            if inputs is None:
                return command != SHUTDOWN
            if command == TRANSFER:
                host.follow(*inputs)  # type: ignore[union-attr]  # the channel checked there is one
            else:
                step.execute(inputs)

    def release_followers(self, shutdown: bool = False) -> None:
        """On process 0: ends the other processes' `follow()` (a no-op on one process)."""
        if self._channel is not None:
            self._channel.release(shutdown)
