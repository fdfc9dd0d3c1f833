"""KVCacheManager: the scheduler's one door to the KV cache's pages (plain Python, no JAX).

The scheduler decides which sequences run and how many tokens each computes; the manager decides
which pages hold them. It owns a PagePool (free list, reference counts, prefix cache) and a
KVCacheGroup (how the layers read their pages), and writes a sequence's KV fields:
`pages` (its page table), `page_hashes` (chained hashes of its full pages) and
`num_cached_pages` (leading pages registered in the prefix cache). Nobody else writes them.

    admission   prefix = computed_prefix(seq)     cached pages of its prefix, never its last
                                                  token (no side effects)
                allocate(seq, n, prefix)           takes the prefix's pages, fresh ones up to n
    each step   allocate(seq, n)                   pages so that seq holds n tokens; False, with
                                                  nothing changed, if they do not fit
                allocate_all([(seq, n), ...])      all of them or none (a decode window)
    after it    cache_computed(seq)                pages full of computed, known tokens -> cache
    drafts      truncate(seq, n)                   gives back pages past n tokens (rejected drafts)
    the end     free(seq)                          every page back, tail first (finish, preemption)

Copy-on-write: fork(parent, child) lets a child share the pages that hold its parent's computed
tokens by reference count. Full pages are never written again, so sharing them is free; the
partial last page is written by both, so the first of the two to write into it gets a fresh
page, and the pair (shared page, fresh page) is queued: `take_page_copies()` hands the pairs to
the step, which must copy each page before any of its KV writes (steps run in order on the
device, so a page freed meanwhile is overwritten only after the copy read it).

Seams for later tiers: the pool's `on_evict(page, hash)` hears of each cached page before it is
reused (a host-memory tier can copy it out first), and `take_events()` drains the BlockStored /
BlockRemoved / AllBlocksCleared events (events.py) for routers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from jaxinfer.kv.events import KVEvent
from jaxinfer.kv.groups import FullAttention, KVCacheGroup
from jaxinfer.kv.page_pool import NULL_PAGE, EvictListener, PagePool
from jaxinfer.kv.prefix_cache import HashFn, hash_page


class KVSequence(Protocol):
    """What the manager reads and writes of a sequence (jaxinfer.core.sequence.Sequence)."""

    token_ids: list[int]
    num_computed_tokens: int  # read only: tokens whose KV is in the cache (or being written)
    pages: list[int]
    page_hashes: list
    num_cached_pages: int
    hash_root: bytes | None  # what its page hashes chain from (a LoRA adapter's; None: the base model)

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_known_tokens(self) -> int: ...

    def cacheable_pages(self, page_size: int) -> int | None: ...


@dataclasses.dataclass(frozen=True)
class ComputedPrefix:
    """Cached pages that hold a sequence's first `num_tokens` tokens (a prefix-cache hit)."""

    pages: tuple[int, ...]  # its page table; NULL_PAGE where the group reads no page
    num_tokens: int


NO_PREFIX = ComputedPrefix((), 0)


class KVCacheManager:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        enable_prefix_caching: bool = True,
        group: KVCacheGroup | None = None,
        hash_fn: HashFn = hash_page,
        enable_events: bool = False,
        on_evict: EvictListener | None = None,
    ):
        self.pool = PagePool(
            num_pages,
            page_size,
            enable_prefix_caching=enable_prefix_caching,
            hash_fn=hash_fn,
            enable_events=enable_events,
            on_evict=on_evict,
        )
        self.page_size = page_size
        self.group = group if group is not None else FullAttention()
        self._releases = self.group.releases_pages
        self._forked = False  # no partial page is shared before a fork: writes need no check
        self._copies: list[tuple[int, int]] = []

    # --- metrics --------------------------------------------------------------------------------
    @property
    def enable_prefix_caching(self) -> bool:
        return self.pool.enable_prefix_caching

    @property
    def num_usable_pages(self) -> int:
        return self.pool.num_usable_pages

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free_pages

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def prefix_cache_queries(self) -> int:
        return self.pool.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.pool.prefix_cache_hits

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.pool.prefix_cache_hit_rate

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    def take_page_copies(self) -> list[tuple[int, int]]:
        """(source page, destination page) pairs of copy-on-write, oldest first, since the last
        call; the step that uses the destinations copies them before its KV writes."""
        copies, self._copies = self._copies, []
        return copies

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    # --- admission ------------------------------------------------------------------------------
    def computed_prefix(self, seq: KVSequence) -> ComputedPrefix:
        """Cached pages of the longest prefix of `seq` the group can use, never covering its last
        token (the step must compute it for logits) nor pages past `seq.cacheable_pages`."""
        pool = self.pool
        if not pool.enable_prefix_caching:
            return NO_PREFIX
        pool.extend_page_hashes(seq.page_hashes, seq.token_ids, seq.hash_root)
        max_pages = (seq.num_tokens - 1) // self.page_size
        cap = seq.cacheable_pages(self.page_size)
        if cap is not None:
            max_pages = min(max_pages, cap)
        pages = self.group.match_prefix(pool, seq.page_hashes, seq.token_ids, max_pages)
        return ComputedPrefix(tuple(pages), len(pages) * self.page_size) if pages else NO_PREFIX

    def _allocate_with_prefix(self, seq: KVSequence, num_tokens: int, prefix: ComputedPrefix) -> bool:
        if seq.pages:
            raise ValueError(f"allocate with a prefix is for admission, but the sequence holds pages {seq.pages}")
        held = [p for p in prefix.pages if p != NULL_PAGE]
        need = max(0, self.pages_for(num_tokens) - len(prefix.pages))
        if not self.pool.can_allocate(need, held):
            return False
        fresh = self.pool.allocate(need, held)[len(held) :]
        seq.pages = [*prefix.pages, *fresh]
        seq.num_cached_pages = len(prefix.pages)
        self.pool.record_prefix_lookup(seq.num_tokens, prefix.num_tokens)
        return True

    # --- each step ------------------------------------------------------------------------------
    def allocate(self, seq: KVSequence, num_tokens: int, prefix: ComputedPrefix | None = None) -> bool:
        """Gives `seq` pages for its first `num_tokens` tokens: a step computes the tokens from
        `seq.num_computed_tokens` to `num_tokens`. False, with nothing changed, if they do not
        fit. `prefix` (admission, from computed_prefix) puts the cached pages first and counts
        the lookup in the hit rate."""
        if prefix is not None:
            return self._allocate_with_prefix(seq, num_tokens, prefix)
        need = -(-num_tokens // self.page_size) - len(seq.pages)
        shared = self._shared_write_page(seq, num_tokens) if self._forked else -1
        skipped = self._skipped_range(seq) if self._releases else None
        if need <= 0 and shared < 0 and not skipped:
            return True  # the common decode step: its page is there already
        need = max(need, 0) + (shared >= 0)
        if need > self.pool.num_free_pages + self._num_freed_by(seq, skipped):
            return False
        if skipped:
            self._release(seq, skipped)
        if shared >= 0:
            self._copy_on_write(seq, shared)
            need -= 1
        if need:
            seq.pages += self.pool.allocate(need)
        return True

    def allocate_all(self, requests: Sequence[tuple[KVSequence, int]]) -> bool:
        """allocate(seq, num_tokens) for every pair, or for none if they do not all fit."""
        total = 0
        for seq, num_tokens in requests:
            total += max(0, self.pages_for(num_tokens) - len(seq.pages))
            total += self._forked and self._shared_write_page(seq, num_tokens) >= 0
        if total > self.pool.num_free_pages:  # pages out of a sliding window only add to these
            return False
        for seq, num_tokens in requests:
            self.allocate(seq, num_tokens)
        return True

    def cache_computed(self, seq: KVSequence) -> None:
        """Registers the pages of `seq` full of computed tokens whose ids are all known
        (placeholders of steps in flight are not) in the prefix cache."""
        num_full = min(seq.num_computed_tokens, seq.num_known_tokens) // self.page_size
        if num_full <= seq.num_cached_pages or not self.pool.enable_prefix_caching:
            return
        known = seq.token_ids[: seq.num_known_tokens]
        self.pool.extend_page_hashes(seq.page_hashes, known, seq.hash_root)
        self.pool.cache_pages(seq.pages, seq.page_hashes, known, seq.num_cached_pages, num_full)
        seq.num_cached_pages = num_full

    def truncate(self, seq: KVSequence, num_tokens: int) -> None:
        """Gives back the pages past those that hold `num_tokens` tokens (rejected drafts)."""
        keep = self.pages_for(num_tokens)
        if len(seq.pages) > keep:
            self.pool.free(seq.pages[keep:])
            del seq.pages[keep:]

    def free(self, seq: KVSequence) -> None:
        """Gives back every page of `seq`, tail first (its deep pages are evicted first)."""
        pages = [p for p in seq.pages if p != NULL_PAGE] if self._releases else seq.pages
        self.pool.free(pages)
        seq.pages, seq.num_cached_pages = [], 0

    # --- copy-on-write --------------------------------------------------------------------------
    def fork(self, parent: KVSequence, child: KVSequence) -> None:
        """`child` shares the pages holding `parent`'s computed tokens. The caller gives the child
        the parent's tokens and num_computed_tokens first; the child holds no pages yet."""
        computed = parent.num_computed_tokens
        if child.pages:
            raise ValueError(f"fork: the child holds pages {child.pages} already")
        if child.num_computed_tokens != computed or child.token_ids[:computed] != parent.token_ids[:computed]:
            raise ValueError(
                f"fork: the child's first {child.num_computed_tokens} computed tokens are not the parent's {computed}"
            )
        shared = parent.pages[: self.pages_for(computed)]
        self.pool.allocate(0, [p for p in shared if p != NULL_PAGE])  # one more reference each
        num_full = computed // self.page_size
        child.pages = list(shared)
        child.page_hashes = parent.page_hashes[:num_full]
        child.num_cached_pages = min(parent.num_cached_pages, num_full)
        self._forked = True

    def _shared_write_page(self, seq: KVSequence, num_tokens: int) -> int:
        """Index of the page the step writes into that another sequence shares, or -1. Only a
        partial page can be: full pages are never written again."""
        computed = seq.num_computed_tokens
        index = computed // self.page_size
        if (
            computed % self.page_size
            and num_tokens > computed
            and index < len(seq.pages)
            and self.pool.ref_count(seq.pages[index]) > 1
        ):
            return index
        return -1

    def _copy_on_write(self, seq: KVSequence, index: int) -> None:
        source = seq.pages[index]
        (copy,) = self.pool.allocate(1)
        self.pool.free([source])  # still referenced by the sequence it is shared with
        seq.pages[index] = copy
        self._copies.append((source, copy))

    # --- pages out of a sliding window ----------------------------------------------------------
    def _skipped_range(self, seq: KVSequence) -> range:
        """Table entries no token of the next step reads that still hold a page."""
        pages = seq.pages
        stop = min(self.group.num_skipped_pages(seq.num_computed_tokens, self.page_size), len(pages))
        start = stop
        while start and pages[start - 1] != NULL_PAGE:  # entries before are given back already
            start -= 1
        return range(start, stop)

    def _num_freed_by(self, seq: KVSequence, skipped: range | None) -> int:
        """Pages that giving back `skipped` entries would put in the free list."""
        if not skipped:
            return 0
        return sum(1 for i in skipped if self.pool.ref_count(seq.pages[i]) == 1)

    def _release(self, seq: KVSequence, skipped: range) -> None:
        self.pool.free([seq.pages[i] for i in skipped])
        for i in skipped:
            seq.pages[i] = NULL_PAGE
