"""Engine: requests in, streamed output deltas out, one jitted step at a time.

    add_request(prompt, SamplingParams) -> validated, tokenized, queued in the Scheduler
    step():
        plan   = scheduler.schedule()            # which sequences, how many tokens each
        handle = worker.execute([plan], previous) # inputs padded to a bucket, ONE jitted call launched
        scheduler.advance(plan)                   # the step's tokens count as computed
        out    = previous.result()                # the step before lands meanwhile (async scheduling)
        scheduler.resolve(plan, out.tokens)       # append tokens, stop on eos / stop ids / strings / length
        outputs.on_token / outputs.delta          # the OutputProcessor's: logprobs, text -> RequestOutput deltas

Bad requests raise ValueError at add_request; the others are untouched. Disaggregated
prefill/decode (kv_transfer_params): worker/disagg.py. Data parallelism (data=N): N replicas,
each its own KVCacheManager and Scheduler; a request goes to the one with the least outstanding
work (prompt + max_tokens of its unfinished requests); a step plans all N, one jitted call.
Several hosts: only process 0 schedules; its worker broadcasts each step's padded inputs
(sharding.StepChannel) to the other processes, whose workers run the same steps in `follow()`.
Pipeline stages (stage=S) with a batch on each: S virtual replicas over one KV cache manager take
turns entering a batch (core/turns.py); each step is one tick and lands the batch that left."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import jax

from jaxinfer.config import EngineConfig
from jaxinfer.core.kv_transfer_params import parse_kv_transfer_params
from jaxinfer.core.plan import SchedulerPlan
from jaxinfer.core.prompts import tokenize_prompt
from jaxinfer.core.replica import build_replicas, replica_stats
from jaxinfer.core.requests import CheckedRequest, RequestLimits, check_request, context_length
from jaxinfer.core.scheduler import Scheduler
from jaxinfer.loader import LoadedModel
from jaxinfer.lora import LoRARequest
from jaxinfer.lora.manager import build_manager, lora_entry
from jaxinfer.output_processor import OutputProcessor, RequestState
from jaxinfer.outputs import RequestMetrics, RequestOutput
from jaxinfer.sampling.beam import BeamSearchParams
from jaxinfer.sampling.params import SamplingParams
from jaxinfer.sampling.rejection import VerifyOutput
from jaxinfer.sampling.sampler import SamplerOutput
from jaxinfer.spec_decode import build_speculator
from jaxinfer.structured import GrammarBackend, grammar_for
from jaxinfer.tokenizer.reasoning import reasoning_parser
from jaxinfer.worker.disagg import Disaggregation
from jaxinfer.worker.step import StepOutput, window_outputs
from jaxinfer.worker.warm_up import enable_compilation_cache
from jaxinfer.worker.worker import StepHandle, Worker
from sharding import StepChannel, is_leader, is_multiprocess


class Engine:
    def __init__(self, model: LoadedModel, config: EngineConfig | None = None, *, warm_up: bool = True):
        config = config or EngineConfig()
        self.model, self.tokenizer = model, model.tokenizer
        self.max_model_len = context_length(config.scheduler.max_model_len, model.config.max_position_embeddings)
        self.config = config = config.with_page_size(self.max_model_len)
        enable_compilation_cache(config.compile.compilation_cache_dir)
        self.worker = Worker(model, config, self.max_model_len, StepChannel() if is_multiprocess() else None)
        self.outputs = OutputProcessor(self.tokenizer)
        lora = (config.lora, model.config, self.worker.load_adapter, config.speculative_config, is_multiprocess())
        self.lora = build_manager(*lora)  # LoRA adapters (jaxinfer/lora/); None: off
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else model.config.eos_token_ids
        slots = self.lora.slots if self.lora is not None else None
        stops, pool, stages = self.outputs.stop_checker, self.worker.kv_pool, self.worker.pipeline_stages
        build = (self.worker.num_replicas, stages, pool, config.scheduler, self.max_model_len, eos, stops, slots)
        self.replicas, self.turns = build_replicas(*build)  # stages > 1: virtual replicas taking turns
        self.kv_cache, self.scheduler = self.replicas[0].kv_cache, self.replicas[0].scheduler  # replica 0's
        self.is_leader = is_leader()
        self.limits = self._request_limits()  # what a request is checked against, once (core/requests.py)
        parser = reasoning_parser(config.load.reasoning_parser)  # structured output: llguidance
        self.grammars = GrammarBackend(self.tokenizer, model.config.vocab_size, parser) if self.tokenizer else None
        self._requests: dict[str, RequestState] = {}
        self._pending: list[RequestOutput] = []  # aborted requests' final outputs
        self._flight: StepHandle | None = None  # the step launched last, tokens not fetched yet
        self._ids = itertools.count()
        self.num_preemptions = self.num_scheduled_tokens = 0  # scheduled: tokens computed (prefix hits excluded)
        self.speculator = build_speculator(config, model, self.worker, self.max_model_len)  # None: off
        self.disagg = Disaggregation(self.worker.state, config.kv_transfer, self.scheduler)  # P/D
        self.warm_up_seconds = 0.0
        if warm_up:
            self.warm_up()

    def warm_up(self) -> None:
        """Compiles every step variant now (compile_in_background: a first request's buckets, the rest later)."""
        background = self.config.compile.compile_in_background and not is_multiprocess()
        self.warm_up_seconds += self.worker.warm_up(background) + self.disagg.warm_up()
        self.warm_up_seconds += self.speculator.warm_up() if self.speculator else 0.0

    def _request_limits(self) -> RequestLimits:
        sched, compiled, eos = self.config.scheduler, self.config.compile, self.scheduler.eos_token_ids
        no_beam = "speculative decoding is on" if self.config.speculative_config else None  # core/beam.py
        return RequestLimits(
            self.model.config.vocab_size,
            self.max_model_len,
            sched.max_request_tokens,
            sched.max_n,
            compiled.penalties,
            compiled.enable_prompt_logprobs,
            self.worker.page_size,
            self.kv_cache.num_usable_pages,
            max_num_seqs=sched.max_num_seqs,
            num_eos=len(eos),
            no_beam_search="it runs on several hosts" if is_multiprocess() else no_beam,
            kv_windows=self.worker.kv_layout.windows,
            max_chunk=self.worker.max_batched_tokens,
            kv_role=self.config.kv_transfer.role,
        )

    # --- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int] | CheckedRequest,
        params: SamplingParams | BeamSearchParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        kv_transfer_params: dict | None = None,
    ) -> str:
        """Queues a request (text, token ids, or a CheckedRequest: not checked again); its id.
        ValueError on bad input, a bad or unknown LoRA adapter (`lora_request`) included.
        `kv_transfer_params`: disaggregated prefill/decode (core/kv_transfer_params.py)."""
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(prompt, CheckedRequest):
            prompt = self.check_request(prompt, params, priority=priority, kv_transfer_params=kv_transfer_params)
        checked = prompt
        ids, params = checked.prompt_token_ids, checked.params
        replica = min(range(len(self.replicas)), key=lambda r: self.replicas[r].load)
        grammar = grammar_for(self.grammars, params)
        adapter = lora_entry(self.lora, request_id, lora_request or checked.lora)
        name, root = (adapter.name, adapter.hash_root) if adapter else (None, None)
        seqs = self.replicas[replica].scheduler.add_request(
            request_id, ids, params, priority=checked.priority, adapter=name, hash_root=root, beam=checked.beam
        )
        if grammar is not None:
            for seq in seqs:
                seq.grammar = grammar.matcher()
        self.disagg.on_request(request_id, checked, seqs, name)
        cost = (len(ids) + params.max_tokens) * params.n
        self.replicas[replica].load += cost
        metrics = RequestMetrics(arrival_time=arrival_time or time.monotonic())
        self._requests[request_id] = self.outputs.new_request(
            request_id, checked.prompt, ids, params, seqs, metrics, replica=replica, cost=cost
        )
        return request_id

    def check_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | BeamSearchParams | None = None,
        *,
        priority: int = 0,
        kv_transfer_params: dict | None = None,
    ) -> CheckedRequest:
        """The request tokenized and checked once (core/requests.py), its grammar compiled,
        without queueing anything: RequestError (a ValueError) naming the problem."""
        params = SamplingParams() if params is None else params
        text, ids = tokenize_prompt(prompt, self.tokenizer)
        kv = parse_kv_transfer_params(kv_transfer_params)
        checked = check_request(ids, params, self.limits, prompt=text, priority=priority, kv_transfer=kv)
        grammar_for(self.grammars, checked.params)
        return checked

    def abort(self, request_id: str) -> bool:
        """Ends a request now and frees its pages; its final output comes with the next step."""
        state = self._requests.get(request_id)
        if state is None:
            return False
        self.replicas[state.replica].scheduler.abort(request_id)
        self._pending.append(self._delta(state, time.monotonic()))
        return True

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._pending) or self._flight is not None or self.worker.busy

    # --- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Launches one jitted step; returns the deltas of the requests that advanced or ended.
        With async scheduling (the default) it launches before the previous step's tokens are
        fetched, and returns the previous step's deltas (unless that one must land first: _landing;
        grammar rows' masks may be filled after it lands, while this step's forward runs)."""
        outputs, self._pending = self._pending, []
        previous, self._flight = self._flight, None
        landing = self._landing(previous) if previous is not None else None
        if landing == "first" and previous is not None:  # landing is None without a previous step
            outputs += self._land(previous)
            previous = None
        self.disagg.before_step(self._requests)  # KV pages pulled from other engines written
        if self.speculator is not None:  # drafts of the sequences that speculate (spec_decode/)
            self.speculator.propose(self.scheduler)
        self.worker.follow_compiles(schedulers := [r.scheduler for r in self.replicas])  # within ready buckets
        plans, entering = self.turns.schedule(schedulers, self.worker.num_decode_steps)
        self.num_preemptions += sum(len(plan.preempted) for plan in plans)
        self.num_scheduled_tokens += sum(plan.num_batched_tokens * plan.num_steps for plan in plans)
        moves = any(p.seqs or p.transfers or p.page_copies for p in plans)  # pages to copy: a step carries them
        launch = moves or self.worker.busy  # busy: the pipeline's batches move on
        flight = self._launch(plans, entering, previous, masks_later=landing == "late") if launch else None
        if previous is not None:
            outputs += self._land(previous)
        if flight is not None and flight.waits_for_masks:  # its grammar rows are past `previous` now
            flight.sample()
        if flight is not None and not self.config.scheduler.async_scheduling:
            outputs += self._land(flight)
            flight = None
        self._flight = flight
        self.turns.settle(self.worker.busy)
        return outputs

    def _landing(self, previous: StepHandle) -> str | None:
        """ "first": rows with penalties need every earlier token on the host (grammar rows their matcher
        past it; speculating rows: Speculator.must_land_first; beams: their group's choice), so the step in
        flight lands before the plan; "late": grammar masks filled after it lands, while the next forward runs."""
        if self.speculator is not None and self.speculator.must_land_first(self.scheduler, previous.plans):
            return "first"
        running = [s for r in self.replicas for s in r.scheduler.running]
        first = any(s.sampling_params.uses_penalties or s.beam is not None for s in running)
        grammar = any(s.grammar is not None for s in running)
        if grammar and not first and self.worker.overlaps_masks and self.config.scheduler.async_scheduling:
            return "late"
        return "first" if first or grammar else None

    def _launch(
        self, plans: list[SchedulerPlan], replicas: list[int], previous: StepHandle | None, masks_later: bool
    ) -> StepHandle:
        start = time.monotonic()
        for entry in (entry for plan in plans for entry in plan.seqs):
            state = self._requests[entry.seq.request_id]
            if state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time, state.cached_prompt_tokens = start, entry.start
        if self.lora is not None:  # adapters given new slots this step: written before it runs
            self.lora.load_pending()
        handle = self.worker.execute(plans, previous, masks_later=masks_later, replicas=replicas)
        for r, plan in zip(replicas, plans):
            self.replicas[r].scheduler.advance(plan)
        self.turns.launched(replicas)
        return handle

    def _land(self, flight: StepHandle) -> list[RequestOutput]:
        """Fetches a launched step's tokens, resolves them and builds the deltas."""
        out = flight.result()
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        for r, plan in enumerate(flight.plans):
            out_r = out if len(flight.plans) == 1 else jax.tree.map(lambda a, r=r: a[r], out)
            scheduler = self.replicas[flight.replicas[r]].scheduler
            if isinstance(out_r, SamplerOutput) and out_r.prompt is not None:  # prompt logprobs, first
                self.outputs.on_prompt_rows(plan, out_r.prompt, self._requests)
            for out_i, updated in self._resolved(plan, out_r, scheduler):  # each emitted before the next
                self.outputs.on_tokens(plan, out_i, updated, self._requests, touched)
        return [self._delta(state, now) for state in touched.values()]

    def _resolved(
        self, plan: SchedulerPlan, out: StepOutput, scheduler: Scheduler
    ) -> Iterator[tuple[SamplerOutput, set[int]]]:
        """(outputs, ids of the sequences given a token) position by position, or step by step."""
        if isinstance(out, VerifyOutput) and self.speculator is not None:
            return self.speculator.resolve(plan, out, scheduler)
        if isinstance(out, SamplerOutput):  # a step's, or a decode window's step by step
            steps, r = enumerate(window_outputs(out, plan.num_steps)), scheduler.resolve  # top: beams' candidates
            return ((o, {s.seq_id for s in r(plan, o.tokens, i, (o.top_ids, o.top_logprobs))}) for i, o in steps)
        raise RuntimeError("a verify step's outputs, but the engine has no speculator")

    def follow(self) -> bool:
        """On processes other than 0: runs process 0's steps until released (False: shut down)."""
        if self.is_leader:
            raise RuntimeError("follow() is for processes other than 0 of a multi-host engine")
        return self.worker.follow()

    def release_followers(self, shutdown: bool = False) -> None:
        """On process 0: ends the other processes' `follow()` (a no-op on one process)."""
        if self.is_leader:
            self.worker.release_followers(shutdown)

    def _delta(self, state: RequestState, now: float) -> RequestOutput:
        out = self.outputs.delta(state, now)
        if out.finished:
            out.kv_transfer_params = self.disagg.on_finished(state)
            if self.lora is not None:
                self.lora.request_finished(state.request_id)
            del self._requests[state.request_id]
            self.outputs.forget(state)
            self.replicas[state.replica].load -= state.cost
        return out

    def stats(self) -> dict:
        return {
            **replica_stats(self.replicas, self.lora),
            "preemptions": self.num_preemptions,
            **self.worker.compile_stats(),  # compiled variants; background compilation's progress
            **self.worker.pipeline_stats(),  # pipeline stages with a batch in flight on each
            **self.disagg.stats(),  # disaggregated prefill/decode
            **(self.speculator.stats() if self.speculator is not None else {}),
        }
