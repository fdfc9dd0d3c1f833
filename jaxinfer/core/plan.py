"""What one step computes: the scheduler's plan, read by the engine and the input builder.

A SchedulerPlan lists, in batch order, each scheduled sequence's share of the step: which of its
tokens are computed (a contiguous chunk starting at its `num_computed_tokens`), the pages that
hold them, and whether the chunk reaches the end of the known tokens (then one token is sampled).
A speculating sequence's chunk is its last known token followed by `drafts` (speculative
decoding): the step writes K/V for all of them and verifies the drafts (spec_decode/).
Plain data (no JAX): `jaxinfer.worker.inputs` turns it into padded arrays.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.core.sequence import Sequence
from jaxinfer.kv import Transfers


@dataclasses.dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step: tokens [start, start + num_new_tokens)."""

    seq: Sequence
    start: int  # num_computed_tokens before the step = position of the first token
    num_new_tokens: int
    pages: tuple[int, ...]  # block table (layer group 0's); covers at least start + num_new_tokens tokens
    sample: bool  # the chunk reaches the end of the known tokens: sample one
    drafts: tuple[int, ...] = ()  # draft tokens after the last known one, to verify
    group_pages: tuple[tuple[int, ...], ...] = ()  # the block tables of layer groups 1 .. G-1

    @classmethod
    def of(
        cls, seq: Sequence, start: int, num_new_tokens: int, sample: bool, drafts: tuple[int, ...] = ()
    ) -> ScheduledSeq:
        """The share of `seq` with a copy of its block tables as they stand (its pages may change
        while the step runs: the plan keeps what the step reads)."""
        pages, *more = seq.page_tables()
        return cls(seq, start, num_new_tokens, pages, sample, drafts, tuple(more))

    @property
    def tables(self) -> tuple[tuple[int, ...], ...]:
        """The block table of each layer group."""
        return (self.pages, *self.group_pages)

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start : self.known_len] + list(self.drafts)

    @property
    def kv_len(self) -> int:
        """Tokens in the cache for this sequence after the step (drafts included)."""
        return self.start + self.num_new_tokens

    @property
    def known_len(self) -> int:
        """kv_len without the drafts: the sequence's tokens up to the step's last known one."""
        return self.start + self.num_new_tokens - len(self.drafts)


@dataclasses.dataclass
class SchedulerPlan:
    seqs: list[ScheduledSeq]  # in batch order: decodes, prefill chunks, new admissions
    preempted: list[Sequence] = dataclasses.field(default_factory=list)
    # > 1: a decode window (core/multistep.py): every entry decodes this many tokens, one per
    # step, in one jitted call; pages for all of them are in `pages`.
    num_steps: int = 1
    # (source, copy) pages the step's worker copies first: a fork's shared, partly filled page
    # that it is about to write into (KVCacheManager's copy-on-write; beam search forks)
    page_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # the host tier's copies the worker makes first: evicted pages out, a prefix hit's pages in
    transfers: Transfers = dataclasses.field(default_factory=Transfers)

    @property
    def verifies(self) -> bool:
        """Some sequence of the plan has drafts: the step verifies them (a verify variant)."""
        return any(s.drafts for s in self.seqs)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    def __len__(self) -> int:
        return len(self.seqs)
