"""Proposer: what drafts tokens for speculative decoding. The engine only ever calls these.

    propose(seqs, max_drafts)  once per step, after the step before has landed: for each running
                               sequence that may speculate (its every token known, one to
                               compute) up to max_drafts[i] draft tokens (fewer or none is fine)
    release(live_seq_ids)      once per step: forget per-sequence state (pages, caches) of every
                               sequence not in the set (finished, aborted or preempted)
    warm_up()                  compile what the proposer runs; returns the seconds it took

Proposals must be deterministic functions of the sequence (q one-hot on the draft): the verify
step then keeps the target's output distribution exactly (sampling/rejection.py). The n-gram
lookup (ngram.py) and a greedy draft model (draft.py) are; a head on the target's hidden states
(EAGLE-style) plugs in the same way, keeping its own state keyed by sequence id.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence as Seq

from jaxinfer.core.sequence import Sequence


class Proposer(abc.ABC):
    @abc.abstractmethod
    def propose(self, seqs: Seq[Sequence], max_drafts: Seq[int]) -> list[list[int]]:
        """Draft tokens for each sequence (at most max_drafts[i] are used)."""

    def release(self, live_seq_ids: set[int]) -> None:  # noqa: B027 - optional: stateless proposers keep none
        """Frees the state of sequences not in `live_seq_ids` (stateless proposers keep none)."""

    def warm_up(self) -> float:
        return 0.0

    def stats(self) -> dict:
        return {}
