"""Engine: requests in, streamed output deltas out, one jitted step at a time.

    add_request(prompt, SamplingParams) -> validated, tokenized, queued in the Scheduler
    step():
        plan   = scheduler.schedule()        # which sequences, how many tokens each
        inputs = runner.prepare(plan)         # numpy, padded to a bucket
        out    = runner.execute(inputs)       # forward + KV write + sampling, one jitted call
        scheduler.update(plan, out.tokens)    # append tokens, stop on eos / stop ids / length
        -> detokenize each new token, cut at stop strings, emit RequestOutput deltas

Stop strings are found in the detokenized text, so they live here: text that could still turn
into a stop string is held back (at most the longest stop string minus one character) and the
sequence is finished through the scheduler when one appears. Bad requests raise ValueError at
add_request and leave every other request untouched.

Data parallelism (a mesh with data=N): N replicas, each with its own PagePool and Scheduler. A
new request goes to the replica with the least outstanding work (prompt + max_tokens of its
unfinished requests); each step schedules every replica and runs all N plans in one jitted call.

Several hosts: only process 0 schedules. Each step's padded inputs are broadcast before the
call (sharding.StepChannel); the other processes sit in `follow()`, running the same steps,
until process 0 calls `release_followers()` (LLM does so after each generate).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import jax

from jaxinfer.config import EngineConfig
from jaxinfer.detokenizer import IncrementalDetokenizer
from jaxinfer.loader import LoadedModel
from jaxinfer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, Usage
from jaxinfer.paging import PagePool
from jaxinfer.runner import ModelRunner, enable_compilation_cache
from jaxinfer.sampling import SamplingParams
from jaxinfer.scheduler import Scheduler
from jaxinfer.sequence import Sequence, SequenceStatus
from sharding import StepChannel, is_leader, is_multiprocess
from sharding.multihost import SHUTDOWN

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _SampleState:
    seq: Sequence
    detok: IncrementalDetokenizer
    text: str = ""  # all text so far (cut at a stop string once found)
    emitted_chars: int = 0
    emitted_tokens: int = 0
    logprobs: list[Logprob] = dataclasses.field(default_factory=list)
    emitted_logprobs: int = 0


@dataclasses.dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_SampleState]
    metrics: RequestMetrics
    cached_prompt_tokens: int = 0
    replica: int = 0
    cost: int = 0  # tokens it may occupy: (prompt + max_tokens) * n


@dataclasses.dataclass
class _Replica:
    pool: PagePool
    scheduler: Scheduler
    load: int = 0  # cost of its unfinished requests


class Engine:
    def __init__(self, model: LoadedModel, config: EngineConfig | None = None, *, warm_up: bool = True):
        self.config = config = config or EngineConfig()
        self.model = model
        self.tokenizer = model.tokenizer
        model_len = model.config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_len:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context of {model_len} tokens")
        self.max_model_len = config.max_model_len or model_len
        enable_compilation_cache(config.compilation_cache_dir)
        self.runner = ModelRunner(model, config, self.max_model_len)
        self.replicas = [self._make_replica(r) for r in range(self.runner.num_replicas)]
        # Replica 0 (the only one without data parallelism).
        self.pool, self.scheduler = self.replicas[0].pool, self.replicas[0].scheduler
        self.is_leader = is_leader()
        self._channel = StepChannel() if is_multiprocess() else None
        self._requests: dict[str, _RequestState] = {}
        self._pending: list[RequestOutput] = []  # aborted requests' final outputs
        self._ids = itertools.count()
        self.num_preemptions = 0
        self.num_scheduled_tokens = 0  # tokens computed by steps so far (prefix hits excluded)
        self.warm_up_seconds = self.runner.warm_up() if warm_up else 0.0

    def _make_replica(self, index: int) -> _Replica:
        config = self.config
        pool = PagePool(self.runner.num_pages, config.page_size,
                        enable_prefix_caching=config.enable_prefix_caching)
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else self.model.config.eos_token_ids
        scheduler = Scheduler(
            pool, max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
            eos_token_ids=eos, seed=config.seed + index)
        return _Replica(pool, scheduler)

    # --- requests -------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0,
                    arrival_time: float | None = None) -> str:
        """Queues a request (text or token ids); returns its id. ValueError on bad input."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if params.uses_penalties and not self.config.penalties:
            raise ValueError("repetition/presence/frequency penalties are off in this engine "
                             "(EngineConfig.penalties=False); start it with penalties on")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        limit = self.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the context of {limit} tokens "
                             "(it must leave room for at least one generated token)")
        replica = min(range(len(self.replicas)), key=lambda r: self.replicas[r].load)
        seqs = self.replicas[replica].scheduler.add_request(request_id, ids, params, priority=priority)
        samples = [_SampleState(seq, self._detokenizer(ids, params)) for seq in seqs]
        cost = (len(ids) + params.max_tokens) * params.n
        self.replicas[replica].load += cost
        self._requests[request_id] = _RequestState(
            request_id, text, ids, params, samples,
            RequestMetrics(arrival_time=arrival_time or time.monotonic()), replica=replica, cost=cost)
        return request_id

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass prompt token ids")
            return prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt token ids are empty")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        return None, ids

    def _detokenizer(self, prompt_ids, params):
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)

    def abort(self, request_id: str) -> bool:
        """Ends a request now and frees its pages; its final output comes with the next step."""
        state = self._requests.get(request_id)
        if state is None:
            return False
        self.replicas[state.replica].scheduler.abort(request_id)
        self._pending.append(self._delta(state, time.monotonic()))
        return True

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._pending)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    # --- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one jitted step; returns deltas of the requests that advanced or ended."""
        outputs, self._pending = self._pending, []
        plans = [replica.scheduler.schedule() for replica in self.replicas]
        self.num_preemptions += sum(len(plan.preempted) for plan in plans)
        self.num_scheduled_tokens += sum(plan.num_batched_tokens for plan in plans)
        if not any(plan.seqs for plan in plans):
            return outputs
        start = time.monotonic()
        for entry in (entry for plan in plans for entry in plan.seqs):
            state = self._requests[entry.seq.request_id]
            if state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = start
                state.cached_prompt_tokens = entry.start
        inputs = self.runner.prepare(plans if len(plans) > 1 else plans[0])
        if self._channel is not None:
            self._channel.send(inputs.token_ids.shape[-1], inputs.sampling.history is not None, inputs)
        out = self.runner.execute(inputs)
        now = time.monotonic()
        touched: dict[str, _RequestState] = {}
        for r, plan in enumerate(plans):
            out_r = out if len(plans) == 1 else jax.tree.map(lambda a: a[r], out)
            updated = {s.seq_id for s in self.replicas[r].scheduler.update(plan, out_r.tokens)}
            for row, entry in enumerate(plan.seqs):
                seq = entry.seq
                state = self._requests.get(seq.request_id)
                if seq.seq_id not in updated or state is None:
                    continue
                self._on_token(state, state.samples[seq.sample_index], out_r, row)
                touched[seq.request_id] = state
        for state in touched.values():
            outputs.append(self._delta(state, now))
        return outputs

    # --- several hosts --------------------------------------------------------------------------
    def follow(self) -> bool:
        """On processes other than 0: runs process 0's steps until it releases this process.
        False when process 0 shut the followers down (no more steps will come)."""
        if self._channel is None or self.is_leader:
            raise RuntimeError("follow() is for processes other than 0 of a multi-host engine")
        while True:
            command, inputs = self._channel.receive(self.runner.padding_inputs)
            if inputs is None:
                return command != SHUTDOWN
            self.runner.execute(inputs)

    def release_followers(self, shutdown: bool = False) -> None:
        """On process 0: ends the other processes' `follow()` (a no-op on one process)."""
        if self._channel is not None and self.is_leader:
            self._channel.release(shutdown)

    def _on_token(self, state: _RequestState, sample: _SampleState, out, row: int) -> None:
        seq, params = sample.seq, state.params
        if params.logprobs is not None:
            n = params.logprobs
            top = {int(i): float(lp) for i, lp in zip(out.top_ids[row][:n], out.top_logprobs[row][:n])}
            sample.logprobs.append(Logprob(seq.last_token_id, float(out.logprobs[row]), top))
        if sample.detok is None:
            return
        sample.text += sample.detok.step([seq.last_token_id])
        if seq.is_finished:
            sample.text += sample.detok.flush()
        if params.stop and seq.status is not SequenceStatus.FINISHED_STOPPED:
            self._check_stop_strings(sample, params, self.replicas[state.replica].scheduler)

    def _check_stop_strings(self, sample: _SampleState, params: SamplingParams, scheduler: Scheduler) -> None:
        longest = max(len(s) for s in params.stop)
        # Only text that arrived this step (plus an overlap) can complete a new stop string.
        search_from = max(0, sample.emitted_chars - longest)
        hits = [(sample.text.find(s, search_from), s) for s in params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return
        index, stop = min(hits)
        sample.text = sample.text[: index + (len(stop) if params.include_stop_str_in_output else 0)]
        if not sample.seq.is_finished:
            scheduler.finish(sample.seq, SequenceStatus.FINISHED_STOPPED, stop_reason=stop)
        else:
            sample.seq.stop_reason = stop
            sample.seq.status = SequenceStatus.FINISHED_STOPPED

    def _delta(self, state: _RequestState, now: float) -> RequestOutput:
        m = state.metrics
        completions = []
        for i, s in enumerate(state.samples):
            seq = s.seq
            hold = 0 if seq.is_finished or not state.params.stop else max(len(x) for x in state.params.stop) - 1
            upto = max(s.emitted_chars, len(s.text) - hold)
            new_ids = seq.output_token_ids[s.emitted_tokens:]
            completions.append(CompletionOutput(
                index=i, text=s.text[s.emitted_chars:upto], token_ids=new_ids,
                logprobs=s.logprobs[s.emitted_logprobs:] if state.params.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
            s.emitted_chars, s.emitted_tokens, s.emitted_logprobs = upto, seq.num_output_tokens, len(s.logprobs)
        if any(c.token_ids for c in completions):
            if m.first_token_time is None:
                m.first_token_time = now
            else:
                m.inter_token_latencies.append(now - m.last_token_time)
            m.last_token_time = now
        finished = all(s.seq.is_finished for s in state.samples)
        if finished:
            m.finished_time = now
            del self._requests[state.request_id]
            self.replicas[state.replica].load -= state.cost
        usage = Usage(prompt_tokens=len(state.prompt_token_ids),
                      completion_tokens=sum(s.seq.num_output_tokens for s in state.samples),
                      cached_prompt_tokens=state.cached_prompt_tokens)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions,
                             finished, usage, m)

    # --- introspection --------------------------------------------------------------------------
    def stats(self) -> dict:
        pools = [r.pool for r in self.replicas]  # summed over data replicas
        total, free = sum(p.num_usable_pages for p in pools), sum(p.num_free_pages for p in pools)
        queries = sum(p.prefix_cache_queries for p in pools)
        return {
            "running": sum(r.scheduler.num_running for r in self.replicas),
            "waiting": sum(r.scheduler.num_waiting for r in self.replicas),
            "kv_pages_total": total, "kv_pages_free": free, "kv_cache_usage": 1.0 - free / total,
            "prefix_cache_hit_rate": sum(p.prefix_cache_hits for p in pools) / queries if queries else 0.0,
            "preemptions": self.num_preemptions, "compiled_variants": self.runner.num_compiled(),
        }
