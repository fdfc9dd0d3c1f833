"""HeldFreesManager: a KV cache manager whose freed pages wait until no batch in flight can still write them.

With pipeline stages and a batch in flight on each (worker/pipelined.py), a sequence can finish
or be aborted while a batch holding it still has stages to run: that batch writes the sequence's
pages once more on each of them, stage s one tick after stage s - 1. A batch that enters later
writes every stage after it, so handing those pages to a later batch is safe as far as steps go;
but page copies (copy-on-write of forks) and the host tier's loads write a page on every stage
at once, before the step they precede, and would be overwritten there. So pages freed while
batches are in flight go back to the pool only once every batch launched before the free has
left the pipeline: `delay` launches later (a pipeline of S stages: S - 1), or as soon as nothing
is in flight. Everything else is the KVCacheManager's.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

from jaxinfer.kv.manager import KVCacheManager


class HeldFreesManager(KVCacheManager):
    def __init__(self, *args: Any, delay: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.delay = delay
        self.launches = 0  # steps launched so far
        self._held: collections.deque[tuple[int, list[list[int]]]] = collections.deque()  # (launches then, tables)

    @property
    def num_held_pages(self) -> int:
        return sum(len(table) for _, tables in self._held for table in tables)

    def free_tables(self, tables: Sequence[Sequence[int]]) -> None:
        self._held.append((self.launches, [list(table) for table in tables]))

    def launched(self) -> None:
        """A step was launched: pages held since `delay` launches ago go back."""
        self.launches += 1
        self.settle(busy=True)

    def settle(self, busy: bool) -> None:
        """Gives back the held pages no batch in flight can write (all of them when none is `busy`)."""
        while self._held and (not busy or self._held[0][0] + self.delay <= self.launches):
            super().free_tables(self._held.popleft()[1])
