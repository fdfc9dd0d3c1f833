"""A prefix-cache hit: the longest prefix every layer group holds, and taking it at admission
(plain Python; the KVCacheManager's `computed_prefix` and `allocate(seq, n, prefix)`).

    longest_prefix(pool, groups, seq)   each group's table of the longest prefix all groups can
                                        use: a group answering shorter makes every group answer
                                        again at that length (a sliding window needs its window's
                                        pages at the length asked, groups.py)
    take_prefix(pool, seq, prefix, n)   the sequence's tables: the hit's device pages shared, a
                                        fresh page for each page the hit found in the host tier
                                        (loaded before the step, host_tier.py; cached on the
                                        device at once), fresh pages up to n pages

A table entry of a hit is a device page, NULL_PAGE where the group reads no page, or -(slot + 1)
for a page held in the host tier's slot `slot`. A preempted sequence's hit may end in pages it
swapped out (swap.py): loaded the same way, not registered in the prefix cache, not counted as
hits, their slots given back once the loads are taken. A sequence whose prompt another engine
computed (disaggregated prefill/decode) starts from the pages pulled into this pool instead
(`received_prefix`), counted and registered the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

from jaxinfer.kv.groups import KVCacheGroup
from jaxinfer.kv.page_pool import NULL_PAGE, PagePool
from jaxinfer.kv.tables import starts


class KVSequence(Protocol):
    """What the manager reads and writes of a sequence (jaxinfer.core.sequence.Sequence)."""

    token_ids: list[int]
    num_computed_tokens: int  # read only: tokens whose KV is in the cache (or being written)
    pages: list[int]  # group 0's page table
    group_pages: list[list[int]]  # the page tables of groups 1 .. G-1 ([] before its first pages)
    page_hashes: list
    num_cached_pages: int
    num_host_hit_tokens: int  # of its admission's prefix hit, tokens whose pages the host tier held
    hash_root: bytes | None  # what its page hashes chain from (a LoRA adapter's; None: the base model)
    adapter: str | None  # the LoRA adapter's name (None: the base model), for KV events
    swap: Any  # a swap.SwappedKV: its pages in the host tier while it waits preempted (else None)
    received: Any  # a ReceivedKV: its prompt's pages pulled from another engine, until admission

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_known_tokens(self) -> int: ...

    def cacheable_pages(self, page_size: int) -> int | None: ...


@dataclasses.dataclass(frozen=True)
class ComputedPrefix:
    """Cached pages that hold a sequence's first `num_tokens` tokens (a prefix-cache hit)."""

    pages: tuple[int, ...]  # group 0's page table of it (module docstring: what an entry holds)
    num_tokens: int
    group_pages: tuple[tuple[int, ...], ...] = ()  # groups 1 .. G-1's
    num_swapped: int = 0  # trailing pages of each table not from the cache: a swap's (swap.py), received ones
    swapped_tokens: int = 0  # the tokens of those
    swap_slots: tuple[int, ...] = ()  # the swap's host slots, given back once taken

    @property
    def tables(self) -> tuple[tuple[int, ...], ...]:
        return (self.pages, *self.group_pages)

    @property
    def num_cached_pages(self) -> int:
        return len(self.pages) - self.num_swapped

    @property
    def num_cached_tokens(self) -> int:
        """Tokens of the hit the prefix cache held (either tier)."""
        return self.num_tokens - self.swapped_tokens

    @property
    def num_host_tokens(self) -> int:
        """Tokens of the cached part whose pages (group 0's) come from the host tier."""
        n = self.num_cached_pages
        return sum(p < 0 for p in self.pages[:n]) * (self.num_cached_tokens // n) if n else 0


NO_PREFIX = ComputedPrefix((), 0)


@dataclasses.dataclass(frozen=True)
class ReceivedKV:
    """Pages of this pool holding a sequence's first `num_tokens` tokens, computed by another
    engine and pulled here (disaggregated prefill/decode): one table per group (NULL_PAGE where
    the other engine held none), each page referenced once until the sequence is admitted."""

    tables: tuple[tuple[int, ...], ...]
    num_tokens: int


def receive_pages(pool: PagePool, pattern: Sequence[str], num_tokens: int) -> ReceivedKV | None:
    """Fresh pages laid out as `pattern` (per group: "1" a page, "0" none); None if they do not fit."""
    need = sum(p.count("1") for p in pattern)
    if not pool.can_allocate(need):
        return None
    fresh = iter(pool.allocate(need))
    return ReceivedKV(tuple(tuple(next(fresh) if c == "1" else NULL_PAGE for c in p) for p in pattern), num_tokens)


def received_prefix(seq: KVSequence, page_size: int) -> ComputedPrefix:
    """The prefix a sequence holding received pages starts from: up to its last token but one,
    like a hit, but not the prefix cache's (not counted as a hit, registered once computed)."""
    received = seq.received
    assert received is not None
    num_tokens = min(received.num_tokens, seq.num_tokens - 1)
    if num_tokens <= 0:
        return NO_PREFIX
    end = -(-num_tokens // page_size)
    tables = [t[:end] for t in received.tables]
    return ComputedPrefix(tables[0], num_tokens, tuple(tables[1:]), num_swapped=end, swapped_tokens=num_tokens)


def longest_prefix(pool: PagePool, groups: Sequence[KVCacheGroup], seq: KVSequence) -> ComputedPrefix:
    """The longest cached prefix of `seq` every group can use (module docstring), never covering
    its last token (the step must compute it for logits) nor pages past `seq.cacheable_pages`."""
    ps = pool.page_size
    pool.extend_page_hashes(seq.page_hashes, seq.token_ids, seq.hash_root)
    limit = (seq.num_tokens - 1) // ps
    cap = seq.cacheable_pages(ps)
    if cap is not None:
        limit = min(limit, cap)
    while limit > 0:
        tables = []
        for i, group in enumerate(groups):
            table = group.match_prefix(pool, seq.page_hashes, seq.token_ids, limit, i)
            if len(table) < limit:
                limit = len(table)
                break
            tables.append(tuple(table))
        else:
            return ComputedPrefix(tables[0], limit * ps, tuple(tables[1:]))
    return NO_PREFIX


def take_prefix(pool: PagePool, seq: KVSequence, prefix: ComputedPrefix, num_pages: int, num_groups: int) -> bool:
    """Gives `seq` (holding no pages) the hit's tables and fresh pages up to `num_pages` in each
    group; False, with nothing changed, if they do not fit (module docstring)."""
    tables = [list(t) for t in prefix.tables] if prefix.pages else [[] for _ in range(num_groups)]
    held = [p for table in tables for p in table if p > 0]
    on_host = [(g, i, -p - 1) for g, table in enumerate(tables) for i, p in enumerate(table) if p < 0]
    need = [max(0, num_pages - len(table)) for table in tables]
    if not pool.can_allocate(sum(need) + len(on_host), held):
        return False
    if on_host:
        assert pool.host is not None  # only a host tier answers with slots
        pool.host.pin([slot for _, _, slot in on_host])  # no offload of this plan takes them
    fresh = pool.allocate(sum(need) + len(on_host), held)[len(held) :]
    cached = prefix.num_cached_pages
    for (g, i, slot), page in zip(on_host, fresh):
        tables[g][i] = page
        pool.host.load(slot, page)  # type: ignore[union-attr]  # on_host: there is a host tier
        if i < cached:
            pool.cache_pages(tables[g], seq.page_hashes, seq.token_ids, i, i + 1, g, seq.adapter)
    fresh = fresh[len(on_host) :]
    for table, start, n in zip(tables, starts(need), need):
        table += fresh[start : start + n]
    seq.pages, *seq.group_pages = tables
    seq.num_cached_pages, seq.num_host_hit_tokens = cached, prefix.num_host_tokens
    pool.record_prefix_lookup(seq.num_tokens, prefix.num_cached_tokens, prefix.num_host_tokens)
    if prefix.swap_slots:
        pool.host.release_swapped(prefix.swap_slots)  # type: ignore[union-attr]  # a swap: a host tier
        seq.swap = None
    return True
