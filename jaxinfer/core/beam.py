"""Beam search over the scheduler's sequences (plain Python): BeamGroup and the queue operations.

A beam-search request is one BeamGroup over sequences of one request id. It starts as one
sequence (the prompt); each live beam is an ordinary running sequence whose step samples
greedily with the top-K logprobs (BeamSearchParams.step_params). When a beam's step lands, the
scheduler does not append the sampled token: it keeps the beam's K candidates
(`seq.beam_candidates`) and the beam waits (core/stops.py's is_awaiting_results) until every live
beam of its group has them. Then `advance_group` runs one search step (BeamGroup.step, HF's
algorithm: sampling/beam.py) and applies it:

    a beam chosen once      gets its chosen token appended (its KV up to there is computed)
    a beam chosen k times   is forked k - 1 times (KVCacheManager.fork: the children share its
                            pages, a partly filled page copied when a child first writes into
                            it), each fork with its own token
    a beam not chosen       is finished first (its pages and its seat in the running batch go
                            to the forks; they still hold what they share)
    the search done         every live beam finished; the request's outputs are the W finished
                            hypotheses, best first (BeamGroup.results)

Beams step together: none is planned while it waits for its group, so the step that feeds a
beam its chosen token always follows the decision. A preempted beam recomputes from its known
tokens like any sequence; its group waits for it. Forks join the running list while it has room
(max_num_seqs), else the waiting queue (recomputing from the prefix cache).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from jaxinfer.core.sequence import Sequence, SequenceStatus
from jaxinfer.sampling.beam import BeamSearchParams

RequestQueue = Any  # core.queue.RequestQueue, which imports this module


@dataclasses.dataclass(frozen=True)
class Hypothesis:
    """A finished beam: its generated tokens, summed log-probability and length-penalised score."""

    token_ids: list[int]
    cum_logprob: float
    score: float
    finish_reason: str  # "stop" (an EOS) | "length"


class BeamGroup:
    def __init__(self, params: BeamSearchParams, eos_token_ids: Iterable[int], first: Sequence):
        self.params = params
        self.eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self.num_candidates = params.num_candidates(len(self.eos))
        self.live: list[Sequence] = [first]
        self.finished: list[Hypothesis] = []
        self.improvable = True  # HF's early-stop heuristic not yet satisfied
        self.done = False
        first.beam, first.beam_score = self, 0.0

    def ready(self) -> bool:
        """Every live beam's candidates have landed."""
        return not self.done and all(s.beam_candidates is not None for s in self.live)

    def step(self) -> list[tuple[Sequence, int, float]]:
        """One search step over the live beams' candidates: (parent, token, summed logprob) of the
        beams that run on, best first; `finished` and `done` updated."""
        cands = sorted(
            ((s.beam_score + lp, b, token) for b, s in enumerate(self.live) for token, lp in s.beam_candidates or ()),
            key=lambda c: (-c[0], c[1], c[2]),
        )[: self.num_candidates]
        generated = self.live[0].num_output_tokens + 1
        width, penalty = self.params.beam_width, self.params.length_penalty
        ends = [token in self.eos or generated >= self.params.max_tokens for _, _, token in cands]
        running = [(self.live[b], token, acc) for (acc, b, token), end in zip(cands, ends) if not end][:width]
        if self.improvable:
            for (acc, b, token), end in list(zip(cands, ends))[:width]:
                if end:
                    tokens = [*self.live[b].output_token_ids, token]
                    reason = "stop" if token in self.eos else "length"
                    self.finished.append(Hypothesis(tokens, acc, acc / generated**penalty, reason))
            self.finished = sorted(self.finished, key=lambda h: -h.score)[:width]
        if self.improvable and len(self.finished) == width and running:
            self.improvable = running[0][2] / generated**penalty > self.finished[-1].score
        self.done = not self.improvable or all(ends) or not running
        return [] if self.done else running

    def results(self) -> list[Hypothesis]:
        """The finished hypotheses, best first."""
        return list(self.finished)


def advance_group(queue: RequestQueue, group: BeamGroup) -> None:
    """Runs one search step of a group whose live beams all have their candidates, and applies it
    to the queue's sequences (the module docstring)."""
    chosen = group.step()
    live = group.live
    known = {seq.seq_id: list(seq.token_ids) for seq in live}  # before any gets its token
    for seq in live:
        seq.beam_candidates = None
    parents = {parent.seq_id for parent, _, _ in chosen}
    for seq in live:  # the beams no choice continues end first: their seats and pages go to forks
        if seq.seq_id not in parents:
            queue.finish(seq, SequenceStatus.FINISHED_STOPPED)
    kept: dict[int, Sequence] = {}
    new_live = []
    for parent, token, acc in chosen:
        if parent.seq_id not in kept:
            kept[parent.seq_id] = parent
            child = parent
        else:
            child = _fork(queue, parent, known[parent.seq_id])
        child.append_token(token)
        child.beam_score = acc
        new_live.append(child)
    group.live = new_live
    if group.done:
        for seq in new_live:
            queue.finish(seq, SequenceStatus.FINISHED_STOPPED)


def _fork(queue: RequestQueue, parent: Sequence, token_ids: list[int]) -> Sequence:
    """A new beam with `parent`'s tokens `token_ids` (its chosen token follows) sharing its pages."""
    entry = queue.requests[parent.request_id]
    child = Sequence(
        queue.new_seq_id(),
        parent.request_id,
        parent.prompt_token_ids,
        parent.sampling_params,
        seed=parent.seed,
        arrival=parent.arrival,
        priority=parent.priority,
        sample_index=len(entry.seqs),
        adapter=parent.adapter,
        hash_root=parent.hash_root,
    )
    child.token_ids = list(token_ids)
    child.beam = parent.beam
    child.lora_slot = 0
    entry.seqs.append(child)
    entry.num_unfinished += 1
    entry.num_active += 1
    seated = parent.status is SequenceStatus.RUNNING and len(queue.running) < queue.max_num_seqs
    if seated and queue.acquire_slot(child):
        child.num_computed_tokens = parent.num_computed_tokens
        queue.kv_cache.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        queue.running.append(child)
    else:  # no seat (or the parent is waiting): it recomputes when admitted
        queue.enqueue_waiting(child)
    return child
