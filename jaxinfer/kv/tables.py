"""One page table's edits, as the KVCacheManager makes them for each layer group (plain Python).

shared_write_page   the entry a step writes into that another sequence shares (copy-on-write)
skipped_range       entries no token of the next step reads that still hold a page (a
                    sliding window's past), and what giving them back frees and does
"""

from __future__ import annotations

from jaxinfer.kv.groups import KVCacheGroup
from jaxinfer.kv.page_pool import NULL_PAGE, PagePool


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
