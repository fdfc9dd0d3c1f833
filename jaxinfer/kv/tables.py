"""One page table's edits, as the KVCacheManager makes them for each layer group (plain Python).

shared_write_page   the entry a step writes into that another sequence shares (copy-on-write)
skipped_range       entries no token of the next step reads that still hold a page (a
                    sliding window's past), and what giving them back frees and does
"""

from __future__ import annotations

from typing import Protocol

from jaxinfer.kv.groups import KVCacheGroup
from jaxinfer.kv.page_pool import NULL_PAGE, PagePool


class _Tokens(Protocol):
    token_ids: list[int]
    page_hashes: list
    hash_root: bytes | None
    adapter: str | None

    @property
    def num_known_tokens(self) -> int: ...


def untouched(tables: list[list[int]], windows: list[int | None], num_computed: int, num_pages: int, ps: int) -> bool:
    """Whether every table holds `num_pages` pages already and none gives any back: a sliding
    window of w (`windows`; None: a group that gives nothing back) has given back the pages before
    num_skipped_pages (groups.SlidingWindow) once the entry before that is null."""
    for table, w in zip(tables, windows):
        if len(table) < num_pages:
            return False
        if w is not None and num_computed >= w:
            stop = min((num_computed - w + 1) // ps, len(table))
            if stop and table[stop - 1] != NULL_PAGE:
                return False
    return True


def cache_released(pool: PagePool, seq: _Tokens, table: list[int], skipped: range, group: int) -> None:
    """Caches the pages a sliding window gives back before the step writing them landed
    (cache_computed would miss them): a step reading them through a prefix hit runs later."""
    known = seq.num_known_tokens
    stop = min(skipped.stop, known // pool.page_size)
    if pool.enable_prefix_caching and stop > skipped.start:
        pool.extend_page_hashes(seq.page_hashes, seq.token_ids[:known], seq.hash_root)
        pool.cache_pages(table, seq.page_hashes, seq.token_ids[:known], skipped.start, stop, group, seq.adapter)


def shared_write_page(pool: PagePool, num_computed: int, table: list[int], num_tokens: int) -> int:
    """Index of the page of `table` a step from `num_computed` to `num_tokens` writes into that
    another sequence shares, or -1. Only a partial page can be: full pages are never written again."""
    index = num_computed // pool.page_size
    if num_computed % pool.page_size and num_tokens > num_computed and index < len(table):
        return index if pool.ref_count(table[index]) > 1 else -1
    return -1


def skipped_range(group: KVCacheGroup, num_computed: int, table: list[int], page_size: int) -> range:
    """Entries of `table` no token from `num_computed` on reads that still hold a page."""
    stop = min(group.num_skipped_pages(num_computed, page_size), len(table))
    start = stop
    while start and table[start - 1] != NULL_PAGE:  # entries before are given back already
        start -= 1
    return range(start, stop)


def num_freed_by(pool: PagePool, table: list[int], skipped: range | None) -> int:
    """Pages that giving back the `skipped` entries would put in the free list."""
    if not skipped:
        return 0
    return sum(1 for i in skipped if pool.ref_count(table[i]) == 1)


def release(pool: PagePool, table: list[int], skipped: range) -> None:
    """Gives the `skipped` entries' pages back; the entries become NULL_PAGE."""
    pool.free([table[i] for i in skipped])
    for i in skipped:
        table[i] = NULL_PAGE


def starts(counts: list[int]) -> list[int]:
    """Where each of consecutive runs of `counts` items starts."""
    out, at = [], 0
    for n in counts:
        out.append(at)
        at += n
    return out
