"""Scheduler: which sequences run in the next step, and how many tokens of each (plain Python).

There are no prefill and decode phases: every sequence has `num_computed_tokens` and catches up
to its length. `schedule()` fills a budget of `max_num_batched_tokens` over at most
`max_num_seqs` running sequences: (1) running sequences that decode, by (priority, arrival);
(2) running sequences part-way through their prompt (chunked prefill), taking what budget they
need; (3) waiting sequences, by (priority, arrival), each taking its cached prefix from the
KV cache manager (never the last token; a prompt whose logprobs are being scored takes only pages
it scored itself, Sequence.cacheable_pages) and a chunk of the rest; the head of the queue blocks
those behind it when its pages do not fit, and nothing is admitted in a step that had to
preempt. A sequence under a LoRA adapter also takes a device slot for it (RequestQueue
.acquire_slot, given back when it finishes or is preempted); one whose adapter finds every slot
in use waits without holding up those behind it. Siblings of an n > 1 request queue as
admission.py lets them; one whose prompt's pages are being pulled from another engine
(disaggregated prefill/decode) waits the same way. Requests that can never run never get here:
the engine checks each one once (core/requests.py) before queueing it.

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
from collections.abc import Iterator
from typing import Any, Protocol, SupportsInt

from jaxinfer.core.beam import advance_group
from jaxinfer.core.multistep import decode_window
from jaxinfer.core.plan import ScheduledSeq, SchedulerPlan
from jaxinfer.core.queue import RequestQueue, sort_key
from jaxinfer.core.sequence import PLACEHOLDER, Sequence, SequenceStatus
from jaxinfer.core.spec import fit_drafts
from jaxinfer.core.stops import is_awaiting_results, stop_decision

TopRows = tuple[Any, Any]  # a step's top logprobs: ids [rows, N] and values [rows, N] (arrays or lists)


class TokenRows(Protocol):
    """A step's sampled token ids, row by row: a list, or the fetched array of them."""

    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[SupportsInt]: ...


@dataclasses.dataclass
class _Step:  # the plan being built, with the budget that is left
    entries: dict[int, ScheduledSeq]
    budget: int
    preempted: list[Sequence]


class Scheduler(RequestQueue):
    """Plans each step over the requests its RequestQueue holds (module docstring)."""

    # --- schedule ---------------------------------------------------------------------------------
    def schedule(self, num_steps: int = 1) -> SchedulerPlan:
        if num_steps > 1 and (window := decode_window(self, num_steps)) is not None:
            window.page_copies, window.transfers = self.kv_cache.take_page_copies(), self.kv_cache.take_transfers()
            return window
        step = _Step({}, self.max_num_batched_tokens, [])
        by_priority = sorted((s for s in self.running if not is_awaiting_results(s, self.max_model_len)), key=sort_key)
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
            self._admit_waiting(step)
        return SchedulerPlan(
            list(step.entries.values()),
            step.preempted,
            page_copies=self.kv_cache.take_page_copies(),
            transfers=self.kv_cache.take_transfers(),
        )

    def _admit_waiting(self, step: _Step) -> None:
        """Admits waiting sequences in order while the budget, the batch and the pages allow. One
        whose LoRA adapter finds no free device slot waits without holding up those behind it."""
        i = 0
        while step.budget > 0 and len(self.running) < self.max_num_seqs and i < len(self.waiting):
            seq = self.waiting[i]
            if seq.pulling or not self._has_seats(seq) or not self.acquire_slot(seq):  # pulling: P/D
                i += 1
                continue
            if not self._admit(seq, i, step):
                self.release_slot(seq)
                break

    def _has_seats(self, seq: Sequence) -> bool:
        """A beam search starts only with room for all its beams in the running batch."""
        group = seq.beam
        if group is None or seq.num_output_tokens or len(group.live) > 1:
            return True
        return len(self.running) + group.params.beam_width <= self.max_num_seqs

    def _plan(self, seq: Sequence, n: int, step: _Step) -> None:
        start = seq.num_computed_tokens
        drafts = tuple(seq.draft_token_ids[: max(0, start + n - seq.num_tokens)])
        step.entries[seq.seq_id] = ScheduledSeq.of(
            seq, start, n, drafts=drafts, sample=start + n - len(drafts) == seq.num_tokens
        )
        step.budget -= n

    def _reserve_pages(self, seq: Sequence, num_tokens: int, step: _Step) -> bool:
        """Gives `seq` pages for `num_tokens`, preempting others; False if `seq` itself was."""
        while not self.kv_cache.allocate(seq, num_tokens):
            victim = max(self.running, key=sort_key)
            self._preempt(victim, step)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, step: _Step) -> None:
        entry = step.entries.pop(seq.seq_id, None)
        if entry is not None:
            step.budget += entry.num_new_tokens
        self.running.remove(seq)
        self.release_slot(seq)
        self.kv_cache.preempt(seq)  # its pages swapped out where cheaper (kv/swap.py)
        seq.num_computed_tokens, seq.draft_token_ids = 0, []
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=sort_key)
        step.preempted.append(seq)

    def _admit(self, seq: Sequence, index: int, step: _Step) -> bool:
        prefix = self.kv_cache.computed_prefix(seq)
        n = min(seq.num_tokens - prefix.num_tokens, step.budget)
        if not self.kv_cache.allocate(seq, prefix.num_tokens + n, prefix):
            return False
        seq.num_computed_tokens = prefix.num_tokens
        del self.waiting[index]
        self.running.append(seq)
        seq.status = SequenceStatus.RUNNING
        self._plan(seq, n, step)
        return True

    # --- after the step -------------------------------------------------------------------------
    def update(self, plan: SchedulerPlan, sampled_token_ids: TokenRows) -> list[Sequence]:
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

    def resolve(
        self, plan: SchedulerPlan, sampled_token_ids: TokenRows, step: int = 0, top: TopRows | None = None
    ) -> list[Sequence]:
        """The step's tokens are known (row i for plan.seqs[i]; rows past the plan are padding);
        `step`: which step of a decode window they come from (windows resolve step by step);
        `top`: the rows' top logprobs (ids, values), a beam's candidates (core/beam.py).
        Returns the sequences that got a token, in plan order (finished ones have no pages), and
        the beams whose candidates landed."""
        if len(sampled_token_ids) < len(plan.seqs):
            raise ValueError(f"{len(sampled_token_ids)} sampled tokens for a plan of {len(plan.seqs)} sequences")
        updated, groups = [], {}
        for row, (entry, token) in enumerate(zip(plan.seqs, sampled_token_ids)):
            seq = entry.seq
            if not entry.sample or seq.is_finished or not seq.num_pending:  # aborted or overrun
                continue
            if seq.beam is not None:  # the search picks its token, once its group has landed
                self._land_beam(seq, entry.known_len, top, row)
                groups[id(seq.beam)] = seq.beam
                updated.append(seq)
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
        for group in groups.values():
            if group.ready():
                advance_group(self, group)
        return updated

    def _land_beam(self, seq: Sequence, index: int, top: TopRows | None, row: int) -> None:
        if top is None:
            raise ValueError(f"beam {seq!r}: its step's top logprobs are needed to choose its token")
        del seq.token_ids[index]  # its placeholder (the only one: beams step one at a time)
        seq.num_pending -= 1
        k = seq.beam.num_candidates if seq.beam is not None else 0
        seq.beam_candidates = [(int(t), float(v)) for t, v in zip(top[0][row][:k], top[1][row][:k])]
        if seq.status is SequenceStatus.RUNNING:
            self.kv_cache.cache_computed(seq)
