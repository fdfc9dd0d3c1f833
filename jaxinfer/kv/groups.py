"""KV cache groups: how the layers of one group use their pages (plain Python).

A group is a set of layers that share one page table per sequence. What differs between kinds
of attention is decided here, and nothing else does; the KVCacheManager asks its group

    match_prefix(pool, hashes, tokens, max_pages)   which cached pages a prefix hit must hold:
                                                    the page table of the prefix, with NULL_PAGE
                                                    where the group never reads a page
    num_skipped_pages(num_computed_tokens, ps)      how many leading pages no token from
                                                    `num_computed_tokens` on reads again: the
                                                    manager gives them back (NULL_PAGE in the table)

    FullAttention   every token reads every earlier one: a hit is the longest run of cached pages
                    from the start, and no page is given back before the sequence ends
    SlidingWindow   a token at position p reads positions p - window + 1 .. p (the kernels'
                    `sliding_window`): a hit needs only the cached pages its first computed token
                    reads, and pages that fell out of the window go back to the pool

The engine has one group today (the worker builds one page table per sequence); models that mix
full and sliding-window layers would give each kind its own group and page table.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import ClassVar

from jaxinfer.kv.page_pool import NULL_PAGE, PagePool
from jaxinfer.kv.prefix_cache import PageHash


class KVCacheGroup(abc.ABC):
    releases_pages: ClassVar[bool] = False  # whether num_skipped_pages can be above 0

    @abc.abstractmethod
    def match_prefix(
        self, pool: PagePool, hashes: Sequence[PageHash], token_ids: Sequence[int], max_pages: int
    ) -> list[int]:
        """The page table of the longest cached prefix of at most `max_pages` full pages that
        this group can use (no side effects); NULL_PAGE where the group reads no page."""

    def num_skipped_pages(self, num_computed_tokens: int, page_size: int) -> int:
        """Leading pages that no token at or after `num_computed_tokens` reads."""
        return 0


@dataclasses.dataclass(frozen=True)
class FullAttention(KVCacheGroup):
    def match_prefix(
        self, pool: PagePool, hashes: Sequence[PageHash], token_ids: Sequence[int], max_pages: int
    ) -> list[int]:
        return pool.match_prefix(hashes, token_ids, max_pages)


@dataclasses.dataclass(frozen=True)
class SlidingWindow(KVCacheGroup):
    window: int  # tokens a query reads, itself included
    releases_pages: ClassVar[bool] = True

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"sliding window={self.window} must be >= 1")

    def num_skipped_pages(self, num_computed_tokens: int, page_size: int) -> int:
        return max(0, num_computed_tokens - self.window + 1) // page_size

    def match_prefix(
        self, pool: PagePool, hashes: Sequence[PageHash], token_ids: Sequence[int], max_pages: int
    ) -> list[int]:
        """Scans down from `max_pages` for a run of cached pages that holds the window of the
        token after it. A prefix of L pages needs pages num_skipped_pages(L * ps) .. L - 1; that
        start never falls as L falls, so when a run's top fails, no shorter prefix inside the
        run can succeed, and the first success is the longest hit."""
        if not pool.enable_prefix_caching:
            return []
        ps = pool.page_size
        run: list[int] = []  # cached pages from the top of the run down to i + 1
        top = min(max_pages, len(hashes))
        for i in range(top - 1, -1, -1):
            page = pool.cached_page(i, hashes, token_ids)
            if page is None:
                run, top = [], i
                continue
            run.append(page)
            if i <= self.num_skipped_pages(top * ps, ps):
                return [NULL_PAGE] * i + run[::-1]
        return []
