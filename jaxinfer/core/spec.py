"""Speculative decoding on the host: drafts into the plan, verified tokens into the sequence.

    before schedule()   the speculator sets seq.draft_token_ids on running sequences that decode
    schedule()          fit_drafts: a decoding sequence takes 1 + d tokens (its last known token
                        and d drafts), d cut to the token budget and to the pages that are free
                        (drafts never preempt anyone); advance() counts only the known token as
                        computed and appends one placeholder, as for a plain decode
    the verify step     returns the target's token at each of the 1 + d positions and how many
                        leading drafts it accepted (sampling/rejection.py)
    resolve()           fills the placeholder with the first token (as for any step); then
                        accept_draft per further token, in order: the draft before it is now a
                        computed token, stops are checked after each (eos, stop ids, max_tokens,
                        the context; stop strings by the output processor), tokens after a stop
                        are dropped
    roll_back           gives back the pages that hold only rejected drafts' K/V; slots of rejected
                        drafts in a kept page lie past num_computed_tokens and are overwritten
                        before anything reads them (attention reads kv_len tokens)

Pages holding rejected drafts are never cached: only pages full of computed, known tokens are.
"""

from __future__ import annotations

from typing import Protocol

from jaxinfer.core.plan import ScheduledSeq
from jaxinfer.core.sequence import Sequence, SequenceStatus
from jaxinfer.core.stops import StopChecker, stop_decision
from jaxinfer.kv import KVCacheManager


class _SchedulerState(Protocol):  # what accept_draft uses of the Scheduler (no import cycle)
    kv_cache: KVCacheManager
    eos_token_ids: frozenset[int]
    max_model_len: int
    stop_checker: StopChecker | None

    def finish(self, seq: Sequence, status: SequenceStatus, stop_reason: int | str | None = None) -> None: ...


def fit_drafts(kv_cache: KVCacheManager, seq: Sequence, budget: int) -> int:
    """Cuts seq's drafts to `budget` tokens and to the pages free now, and reserves pages for the
    known token and the drafts left; returns how many drafts are left."""
    drafts = seq.draft_token_ids
    if not drafts:
        return 0
    n = min(len(drafts), max(budget, 0))
    first = seq.num_computed_tokens + 1  # the known token's slot comes first
    while n and not kv_cache.allocate(seq, first + n):  # nothing changes when it fails
        n -= 1
    del drafts[n:]
    return n


def accept_draft(scheduler: _SchedulerState, entry: ScheduledSeq, token: int) -> bool:
    """The verify step's next token for `entry` (after its first, which resolve() placed): the
    draft before it was accepted, so its K/V is a computed token now. False if the sequence had
    already finished (a stop earlier in the run, or an abort): the token is dropped."""
    seq = entry.seq
    if seq.status is not SequenceStatus.RUNNING or seq.num_pending:
        return False
    seq.num_computed_tokens += 1
    seq.token_ids.append(int(token))
    scheduler.kv_cache.cache_computed(seq)
    decision = stop_decision(seq, scheduler.eos_token_ids, scheduler.max_model_len, scheduler.stop_checker)
    if decision:
        scheduler.finish(seq, *decision)
    return True


def roll_back(kv_cache: KVCacheManager, seq: Sequence) -> None:
    """After a verify step: frees the pages past those the sequence's tokens need."""
    if seq.status is not SequenceStatus.RUNNING:
        return  # finished: every page is free already
    kv_cache.truncate(seq, seq.num_tokens)
