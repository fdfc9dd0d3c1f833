"""When a sequence stops: the decision for its newest known token (plain Python).

In order: eos (unless ignore_eos), a stop token id, the caller's stop checker (e.g. stop strings
found in detokenized text), then length (max_tokens, or the context is full). With async
scheduling the token decided on may be followed by placeholders of steps in flight; they count
for neither the token nor the length.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxinfer.core.sequence import Sequence, SequenceStatus

# Called after a token is known; returns a stop reason (e.g. the matched stop string) or None.
StopChecker = Callable[[Sequence], "int | str | None"]
Decision = tuple[SequenceStatus, "int | str | None"]


def stop_decision(
    seq: Sequence, eos_token_ids: frozenset[int], max_model_len: int, checker: StopChecker | None = None
) -> Decision | None:
    """(finished status, stop reason) if `seq` ends at its last known token, else None."""
    params, token = seq.sampling_params, seq.last_token_id
    num_known = seq.num_known_tokens
    if not params.ignore_eos and token in eos_token_ids:
        return SequenceStatus.FINISHED_STOPPED, None
    if token in params.stop_token_ids:
        return SequenceStatus.FINISHED_STOPPED, token
    if checker is not None and (reason := checker(seq)) is not None:
        return SequenceStatus.FINISHED_STOPPED, reason
    if num_known - seq.num_prompt_tokens >= params.max_tokens or num_known >= max_model_len:
        return SequenceStatus.FINISHED_LENGTH, None
    return None


def is_awaiting_results(seq: Sequence, max_model_len: int) -> bool:
    """Its steps in flight already sample its last allowed token: nothing more to compute; or a
    beam whose next token its group has not chosen yet (core/beam.py)."""
    if seq.beam is not None:
        return seq.num_pending > 0 or seq.beam_candidates is not None
    return seq.num_pending > 0 and (
        seq.num_output_tokens >= seq.sampling_params.max_tokens or seq.num_tokens >= max_model_len
    )
