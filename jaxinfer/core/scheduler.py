"""Scheduler: which sequences run in the next step, and how many tokens of each (plain Python).

There are no prefill and decode phases: every sequence has `num_computed_tokens` and catches up
to its length. `schedule()` fills a budget of `max_num_batched_tokens` over at most
`max_num_seqs` running sequences: (1) running sequences that decode, by (priority, arrival);
(2) running sequences part-way through their prompt (chunked prefill), taking what budget they
need; (3) waiting sequences, by (priority, arrival), each taking its cached prefix from the
KV cache manager (never the last token; a prompt whose logprobs are being scored takes only pages
it scored itself, Sequence.cacheable_pages) and a chunk of the rest; the head of the queue blocks
those behind it when its pages do not fit, and nothing is admitted in a step that had to
preempt. Siblings of an n > 1 request queue as admission.py lets them. Requests that can never
run never get here: the engine checks each one once (core/requests.py) before queueing it.

Pages come from the KV cache manager (jaxinfer.kv), the scheduler's only view of them: reserved
for exactly the tokens a step computes, cached once computed, freed at the end. When none is
free, the lowest-priority, newest running sequence (possibly the one asking) is preempted: pages
freed, back to its place in the queue, recomputed later (mostly from the prefix cache); if
already planned, its tokens go back to the budget.

`advance(plan)` (at dispatch) moves `num_computed_tokens` on and appends a PLACEHOLDER for each
token the step samples; `resolve(plan, sampled)` (when the tokens reach the host) fills them in,
caches pages full of known tokens and checks stops (stops.py); `update` is both. With async
scheduling the next step is planned between the two: a placeholder's sequence decodes again with
its input filled in on the device, one whose placeholders reach max_tokens or the context is not
planned again, and a stop drops the placeholders after it (overrun, never emitted). A decode
window (multistep.py) samples k tokens per sequence and resolves step by step. A sequence with
drafts (speculative decoding) computes them too; they count once verified (spec.py). Abort,
finish and preemption cost O(the request's samples) plus bisect work on the sorted queue, never
a scan.
"""

from __future__ import annotations

import bisect
import dataclasses
import operator
import random
from collections.abc import Iterable

from jaxinfer.core.admission import RequestEntry
from jaxinfer.core.multistep import decode_window
from jaxinfer.core.plan import ScheduledSeq, SchedulerPlan
from jaxinfer.core.sequence import PLACEHOLDER, Sequence, SequenceStatus, sample_seed
from jaxinfer.core.spec import fit_drafts
from jaxinfer.core.stops import StopChecker, is_awaiting_results, stop_decision
from jaxinfer.kv import KVCacheManager
from jaxinfer.sampling.params import SamplingParams

_sort_key = operator.attrgetter("sort_key")  # (priority, arrival, sample index)


@dataclasses.dataclass
class _Step:  # the plan being built, with the budget that is left
    entries: dict[int, ScheduledSeq]
    budget: int
    preempted: list[Sequence]


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        stop_checker: StopChecker | None = None,
        seed: int = 0,
        max_seqs_per_request: int | None = None,
    ):
        for name, value in (
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_num_seqs", max_num_seqs),
            ("max_model_len", max_model_len),
            ("max_seqs_per_request", max_seqs_per_request or 1),
        ):
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        self.kv_cache = kv_cache
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_checker = stop_checker
        self.max_seqs_per_request = max_seqs_per_request  # None: no window
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []  # in admission order (at most max_num_seqs)
        self.requests: dict[str, RequestEntry] = {}  # unfinished requests
        self._num_held = 0  # siblings not yet in the queue
        self._rng = random.Random(seed)  # seeds of unseeded requests
        self._next_seq_id = 0
        self._next_arrival = 0

    # --- requests ---------------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, *, priority: int = 0
    ) -> list[Sequence]:
        """Queues one Sequence per sample (sampling_params.n) of a request that passed
        core/requests.py's checks (the engine's, once): nothing here checks it again."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival, self._next_arrival = self._next_arrival, self._next_arrival + 1
        base_seed = sampling_params.seed if sampling_params.seed is not None else self._rng.getrandbits(64)
        seqs: list[Sequence] = []
        for i in range(sampling_params.n):
            seq = Sequence(
                self._next_seq_id,
                request_id,
                prompt_token_ids,
                sampling_params,
                seed=sample_seed(base_seed, i),
                arrival=arrival,
                priority=priority,
                sample_index=i,
                parent=seqs[0] if seqs else None,
            )
            self._next_seq_id += 1
            seqs.append(seq)
        self.requests[request_id] = entry = RequestEntry.new(seqs)
        self._num_held += len(entry.held)
        self._enqueue(entry, seqs[0])
        return seqs

    def abort(self, request_id: str) -> list[Sequence]:
        """Finishes every unfinished sequence of the request; unknown ids abort nothing."""
        entry = self.requests.get(request_id)
        if entry is None:
            return []
        held = list(entry.held)
        entry.held.clear()
        self._num_held -= len(held)
        for seq in held:  # never queued: nothing to remove, no pages
            seq.status = SequenceStatus.FINISHED_ABORTED
        entry.num_unfinished -= len(held)
        active = [s for s in entry.seqs if not s.is_finished]
        for seq in active:
            self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        if entry.num_unfinished == 0:
            self.requests.pop(request_id, None)
        return held + active

    def finish(self, seq: Sequence, status: SequenceStatus, stop_reason: int | str | None = None):
        """Ends a queued or running sequence (any finished status) and frees its pages."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)  # at most max_num_seqs long
        else:
            self._dequeue(seq)
        self.kv_cache.free(seq)
        if seq.num_pending:  # tokens of steps in flight past the end: overrun, never emitted
            del seq.token_ids[-seq.num_pending :]
            seq.num_pending = 0
        seq.status, seq.stop_reason = status, stop_reason
        entry = self.requests[seq.request_id]
        entry.num_active -= 1
        entry.num_unfinished -= 1
        if entry.num_unfinished == 0:
            del self.requests[seq.request_id]
        else:
            self._release(entry)

    def _enqueue(self, entry: RequestEntry, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=_sort_key)
        entry.num_active += 1

    def _dequeue(self, seq: Sequence) -> None:
        i = bisect.bisect_left(self.waiting, seq.sort_key, key=_sort_key)
        while self.waiting[i] is not seq:  # sort keys are unique per sequence; this is a guard
            i += 1
        del self.waiting[i]

    def _release(self, entry: RequestEntry) -> None:
        """Lets held siblings into the queue as the request's window allows (admission.py)."""
        count = entry.releasable(self.max_seqs_per_request)
        if not count:
            return
        fresh = entry.num_waves > 0  # later waves queue behind the requests that came since
        entry.num_waves += 1
        for _ in range(count):
            seq = entry.held.popleft()
            if fresh:
                seq.arrival, self._next_arrival = self._next_arrival, self._next_arrival + 1
            self._num_held -= 1
            self._enqueue(entry, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._num_held)

    @property
    def num_waiting(self) -> int:
        """Sequences queued or held back (siblings waiting for their parent or their turn)."""
        return len(self.waiting) + self._num_held

    @property
    def num_running(self) -> int:
        return len(self.running)

    # --- schedule ---------------------------------------------------------------------------------
    def schedule(self, num_steps: int = 1) -> SchedulerPlan:
        if num_steps > 1 and (window := decode_window(self, num_steps)) is not None:
            return window
        step = _Step({}, self.max_num_batched_tokens, [])
        by_priority = sorted((s for s in self.running if not is_awaiting_results(s, self.max_model_len)), key=_sort_key)
        decodes = [s for s in by_priority if s.num_tokens - s.num_computed_tokens == 1]
        prefills = [s for s in by_priority if s.num_tokens - s.num_computed_tokens > 1]
        for seq in decodes + prefills:
            if step.budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted for an earlier one
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, step.budget)
            n += fit_drafts(self.kv_cache, seq, step.budget - n)  # speculative decoding (spec.py)
            if self._reserve_pages(seq, seq.num_computed_tokens + n, step):
                self._plan(seq, n, step)
        if not step.preempted:
            while step.budget > 0 and len(self.running) < self.max_num_seqs:
                if not self.waiting or not self._admit(self.waiting[0], step):
                    break
        return SchedulerPlan(list(step.entries.values()), step.preempted)

    def _plan(self, seq: Sequence, n: int, step: _Step) -> None:
        start = seq.num_computed_tokens
        drafts = tuple(seq.draft_token_ids[: max(0, start + n - seq.num_tokens)])
        step.entries[seq.seq_id] = ScheduledSeq(
            seq, start, n, tuple(seq.pages), drafts=drafts, sample=start + n - len(drafts) == seq.num_tokens
        )
        step.budget -= n

    def _reserve_pages(self, seq: Sequence, num_tokens: int, step: _Step) -> bool:
        """Gives `seq` pages for `num_tokens`, preempting others; False if `seq` itself was."""
        while not self.kv_cache.allocate(seq, num_tokens):
            victim = max(self.running, key=_sort_key)
            self._preempt(victim, step)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, step: _Step) -> None:
        entry = step.entries.pop(seq.seq_id, None)
        if entry is not None:
            step.budget += entry.num_new_tokens
        self.running.remove(seq)
        self.kv_cache.free(seq)
        seq.num_computed_tokens, seq.draft_token_ids = 0, []
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=_sort_key)
        step.preempted.append(seq)

    def _admit(self, seq: Sequence, step: _Step) -> bool:
        prefix = self.kv_cache.computed_prefix(seq)
        n = min(seq.num_tokens - prefix.num_tokens, step.budget)
        if not self.kv_cache.allocate(seq, prefix.num_tokens + n, prefix):
            return False
        seq.num_computed_tokens = prefix.num_tokens
        del self.waiting[0]  # the head of the queue
        self.running.append(seq)
        seq.status = SequenceStatus.RUNNING
        self._plan(seq, n, step)
        return True

    # --- after the step -------------------------------------------------------------------------
    def update(self, plan: SchedulerPlan, sampled_token_ids) -> list[Sequence]:
        """advance + resolve: applies a one-step plan whose tokens are already known."""
        self.advance(plan)
        return self.resolve(plan, sampled_token_ids)

    def advance(self, plan: SchedulerPlan) -> None:
        """At dispatch: the step's tokens count as computed; placeholders for what it samples."""
        extra = plan.num_steps - 1  # a decode window computes its first k - 1 samples too
        for entry in plan.seqs:
            seq = entry.seq
            if seq.status is not SequenceStatus.RUNNING:  # aborted since schedule()
                continue
            seq.num_computed_tokens = entry.known_len + extra  # drafts: when verified (spec.py)
            if entry.sample:
                seq.token_ids += [PLACEHOLDER] * plan.num_steps
                seq.num_pending += plan.num_steps

    def resolve(self, plan: SchedulerPlan, sampled_token_ids, step: int = 0) -> list[Sequence]:
        """The step's tokens are known (row i for plan.seqs[i]; rows past the plan are padding);
        `step`: which step of a decode window they come from (windows resolve step by step).
        Returns the sequences that got a token, in plan order (finished ones have no pages)."""
        if len(sampled_token_ids) < len(plan.seqs):
            raise ValueError(f"{len(sampled_token_ids)} sampled tokens for a plan of {len(plan.seqs)} sequences")
        updated = []
        for entry, token in zip(plan.seqs, sampled_token_ids):
            seq = entry.seq
            if not entry.sample or seq.is_finished or not seq.num_pending:  # aborted or overrun
                continue
            if seq.sampling_params.max_tokens == 0:  # the prompt scored: its sampled token is no output
                self.kv_cache.cache_computed(seq)
                self.finish(seq, SequenceStatus.FINISHED_LENGTH)  # drops the placeholder
                updated.append(seq)
                continue
            seq.token_ids[entry.known_len + step] = int(token)  # the first placeholder left
            seq.num_pending -= 1
            if seq.status is SequenceStatus.RUNNING:
                self.kv_cache.cache_computed(seq)
            if decision := stop_decision(seq, self.eos_token_ids, self.max_model_len, self.stop_checker):
                self.finish(seq, *decision)
            updated.append(seq)
            if seq.sample_index == 0 and seq.num_known_tokens - seq.num_prompt_tokens == 1 and not seq.is_finished:
                self._release(self.requests[seq.request_id])  # the prompt is computed
        return updated
