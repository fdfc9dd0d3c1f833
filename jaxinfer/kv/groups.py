"""KV cache groups: how the layers of one group use their pages (plain Python).

A group is a set of layers that share one page table per sequence. What differs between kinds
of attention is decided here, and nothing else does; the KVCacheManager asks its group

    match_prefix(pool, hashes, tokens, max_pages, cache)
                                                    which cached pages a prefix hit must hold
                                                    (found in the pool's prefix cache `cache`):
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

Which layers form which group is the model's KV layout (jaxinfer/config/kv_layout.py): a model
whose layers all attend alike has one group; Gemma 2 / 3 mix full and sliding-window groups, each
with a page table per sequence, all drawing from one page pool.
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
        self, pool: PagePool, hashes: Sequence[PageHash], token_ids: Sequence[int], max_pages: int, cache: int = 0
    ) -> list[int]:
        """The page table of the longest cached prefix of at most `max_pages` full pages that
        this group can use (no side effects); NULL_PAGE where the group reads no page."""

    def num_skipped_pages(self, num_computed_tokens: int, page_size: int) -> int:
        """Leading pages that no token at or after `num_computed_tokens` reads."""
        return 0

    def max_pages_held(self, num_tokens: int, chunk: int, page_size: int) -> int:
        """The most pages a sequence of `num_tokens` tokens holds while steps of `chunk` tokens
        compute it (a page table's entries not given back)."""
        return -(-num_tokens // page_size)


def group_for(window: int | None, margin: int = 0) -> KVCacheGroup:
    """The group of layers with this sliding window (None: full attention); `margin` widens the
    window (a drafter computes again up to that many tokens it had computed)."""
    return FullAttention() if window is None else SlidingWindow(window + margin)


@dataclasses.dataclass(frozen=True)
class FullAttention(KVCacheGroup):
    def match_prefix(
        self, pool: PagePool, hashes: Sequence[PageHash], token_ids: Sequence[int], max_pages: int, cache: int = 0
    ) -> list[int]:
        return pool.match_prefix(hashes, token_ids, max_pages, cache)


@dataclasses.dataclass(frozen=True)
class SlidingWindow(KVCacheGroup):
    window: int  # tokens a query reads, itself included
    releases_pages: ClassVar[bool] = True

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"sliding window={self.window} must be >= 1")

    def num_skipped_pages(self, num_computed_tokens: int, page_size: int) -> int:
        return max(0, num_computed_tokens - self.window + 1) // page_size

    def max_pages_held(self, num_tokens: int, chunk: int, page_size: int) -> int:
        """A step from position s reads and writes positions s - window + 1 .. s + chunk - 1:
        window + chunk - 1 tokens, over one page more than they fill where they start mid-page."""
        span = self.window - 1 + chunk
        return min(-(-num_tokens // page_size), -(-span // page_size) + 1)

    def match_prefix(
        self, pool: PagePool, hashes: Sequence[PageHash], token_ids: Sequence[int], max_pages: int, cache: int = 0
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
            page = pool.cached_page(i, hashes, token_ids, cache)
            if page is None:
                run, top = [], i
                continue
            run.append(page)
            if i <= self.num_skipped_pages(top * ps, ps):
                return [NULL_PAGE] * i + run[::-1]
        return []
