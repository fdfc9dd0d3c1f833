"""Multi-step decode: one plan whose sequences each decode `k` tokens in one jitted call.

When every sequence the scheduler would run is a plain decode (one token to compute, nothing
waiting to be admitted, no penalty history to keep on the host, no grammar whose next mask
needs the token before it), the step loop can run k decode
steps on the device with the sampler inside, paying the host's dispatch, transfer and planning
costs once per k tokens. `decode_window` reserves pages for all k tokens first, for every
sequence or none (never preempting: if they do not fit, it declines and the scheduler plans one
step as usual), and every sequence must have room for k more positions within max_model_len.

Tokens past a stop (eos, stop ids or strings, max_tokens) inside the window are overrun: the
scheduler's `finish` drops them (they are never emitted) and frees the pages, as for async
scheduling. The host sees the k tokens of each sequence in order, so stops, logprobs and stream
deltas are those of k single steps; per-request seeds fold in the token's index, so sampled
outputs are identical too.
"""

from __future__ import annotations

from typing import Protocol

from jaxinfer.core.plan import ScheduledSeq, SchedulerPlan
from jaxinfer.core.sequence import Sequence
from jaxinfer.core.stops import is_awaiting_results
from jaxinfer.kv import KVCacheManager


class _SchedulerState(Protocol):  # what a window reads of the Scheduler (no import cycle)
    kv_cache: KVCacheManager
    running: list[Sequence]
    max_model_len: int
    max_num_batched_tokens: int

    @property
    def num_waiting(self) -> int: ...


def decode_window(scheduler: _SchedulerState, num_steps: int) -> SchedulerPlan | None:
    """A plan of `num_steps` decode steps for every running sequence, or None if the next step
    must be an ordinary one (a prefill, an admission, penalties, a grammar, drafts to verify, no
    room, or no pages)."""
    if num_steps < 2 or scheduler.num_waiting:
        return None
    seqs = sorted(
        (s for s in scheduler.running if not is_awaiting_results(s, scheduler.max_model_len)), key=lambda s: s.sort_key
    )
    if not seqs or len(seqs) > scheduler.max_num_batched_tokens:
        return None
    for seq in seqs:
        if (
            seq.num_tokens - seq.num_computed_tokens != 1
            or seq.sampling_params.uses_penalties
            or seq.grammar is not None
            or seq.draft_token_ids
            or seq.beam is not None  # its next token is the host's choice, step by step
            or seq.num_tokens + num_steps - 1 > scheduler.max_model_len
        ):
            return None
    if not scheduler.kv_cache.allocate_all([(s, s.num_computed_tokens + num_steps) for s in seqs]):
        return None
    entries = [ScheduledSeq.of(s, s.num_computed_tokens, 1, sample=True) for s in seqs]
    return SchedulerPlan(entries, num_steps=num_steps)
