"""HeldFreesManager: a KV cache manager whose freed pages wait until no batch in flight can still write them.

With pipeline stages and a batch in flight on each (worker/pipelined.py), a sequence can finish
or be aborted while a batch holding it still has stages to run: that batch writes the sequence's
pages once more on each of them, stage s one tick after stage s - 1. A batch that enters later
writes every stage after it, so handing those pages to a later batch is safe as far as steps go;
but page copies (copy-on-write of forks) and the host tier's loads write a page on every stage
at once, before the step they precede, and would be overwritten there. So pages freed while
batches are in flight go back to the pool only once every batch launched before the free has
left the pipeline: `delay` launches later (a pipeline of S stages: S - 1), or as soon as nothing
is in flight. A preempted sequence's pages go back at once: its replica plans only once its last
batch has left (core/turns.py), so no batch in flight holds it.

The replicas that share this manager each admit up to their own max_num_seqs, so more sequences
grow in one pool than one scheduler would run, and a replica short of pages can preempt only its
own: admitting into the last free pages thrashes (the 16 HF prompts in 48 pages of the llama3
fixture: 17 preemptions on stage=2, none on one device). So an admission also leaves a page free
for each sequence holding pages (what their next tokens may need): the same run then preempts
none. Everything else is the KVCacheManager's.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

from jaxinfer.kv.manager import KVCacheManager
from jaxinfer.kv.prefix import ComputedPrefix, KVSequence


class HeldFreesManager(KVCacheManager):
    def __init__(self, *args: Any, delay: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.delay = delay
        self.launches = 0  # steps launched so far
        self._held: collections.deque[tuple[int, list[list[int]]]] = collections.deque()  # (launches then, tables)
        self._holding: set[int] = set()  # id() of each sequence admitted and not freed yet
        self._at_once = False  # freeing a preempted sequence's pages

    @property
    def num_held_pages(self) -> int:
        return sum(len(table) for _, tables in self._held for table in tables)

    def _allocate_with_prefix(self, seq: KVSequence, num_tokens: int, prefix: ComputedPrefix) -> bool:
        """Admission, leaving a page for each sequence holding pages (module docstring)."""
        growing = len(self._holding) - (id(seq) in self._holding)  # the others holding pages
        if self.num_free_pages - self.pages_for(num_tokens) < growing:
            return False
        if not super()._allocate_with_prefix(seq, num_tokens, prefix):
            return False
        self._holding.add(id(seq))
        return True

    def detach(self, seq: KVSequence) -> list[list[int]]:
        self._holding.discard(id(seq))
        return super().detach(seq)

    def preempt(self, seq: KVSequence) -> bool:
        self._at_once = True
        try:
            return super().preempt(seq)
        finally:
            self._at_once = False

    def free_tables(self, tables: Sequence[Sequence[int]]) -> None:
        if self._at_once:
            super().free_tables(tables)
        else:
            self._held.append((self.launches, [list(table) for table in tables]))

    def launched(self) -> None:
        """A step was launched: pages held since `delay` launches ago go back."""
        self.launches += 1
        self.settle(busy=True)

    def settle(self, busy: bool) -> None:
        """Gives back the held pages no batch in flight can write (all of them when none is `busy`)."""
        while self._held and (not busy or self._held[0][0] + self.delay <= self.launches):
            super().free_tables(self._held.popleft()[1])
