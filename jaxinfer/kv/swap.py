"""Swapping a preempted sequence's pages to the host tier and back (plain Python).

A preempted sequence gives its pages back. Its full pages registered in the prefix cache stay
cached there (and in the host tier once evicted), so it finds them again when it returns; the
rest -- the partial last page, pages of tokens not known when it was preempted, every page when
prefix caching is off -- would be recomputed. With a host tier the KVCacheManager may instead
copy them to host slots held for the sequence (outside the tier's LRU) and load them back at its
readmission, when the measured cost model says that is cheaper:

    preempt       swap_out(host, tables, seq)     the uncached computed pages -> host slots
                                                  (offloads before the next step), on seq.swap
    readmission   with_swap(prefix, seq, ...)     the prefix hit extended by the swapped pages
                                                  (-(slot + 1) entries: loaded like host hits,
                                                  never registered in the prefix cache)
    finish        the slots given back (KVCacheManager.free)

SwapCost compares the two from measurements taken at start-up (worker/kv_host.py times its
transfer calls, the compiled step one full token bucket): swapping costs one offload and one
load call per batch of `width` pages, recomputing costs the tokens' share of a prefill step.
Recompute is priced by the step's linear work only (its attention over the context is not), so
the model errs towards recomputing.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jaxinfer.kv.page_pool import NULL_PAGE

if TYPE_CHECKING:
    from jaxinfer.kv.host_tier import HostTier
    from jaxinfer.kv.prefix import ComputedPrefix, KVSequence


@dataclasses.dataclass
class SwapCost:
    """Measured seconds: one offload + one load call of up to `width` pages; one token's share of
    a prefill step (0 until the worker's warm-up measured it: preemption then recomputes). The
    worker fills it in; every replica's KV cache manager holds the same one."""

    transfer_s: float
    width: int
    token_s: float = 0.0

    def swap_is_cheaper(self, num_pages: int, num_tokens: int) -> bool:
        """Whether moving `num_pages` pages out and back beats recomputing `num_tokens` tokens."""
        return -(-num_pages // self.width) * self.transfer_s < num_tokens * self.token_s


@dataclasses.dataclass(frozen=True)
class SwappedKV:
    """A preempted sequence's pages first_page .. of each group, held in host slots: entries are
    -(slot + 1), or NULL_PAGE where the group held no page (a sliding window's past)."""

    num_tokens: int  # tokens whose KV the pages hold (num_computed_tokens when preempted)
    first_page: int  # the pages before it are the prefix cache's
    tables: tuple[tuple[int, ...], ...]
    epoch: int  # the host tier's when taken (new weights: stale)

    @property
    def slots(self) -> list[int]:
        return [-p - 1 for table in self.tables for p in table if p < 0]


def swap_out(host: HostTier, tables: list[list[int]], seq: KVSequence, page_size: int) -> SwappedKV | None:
    """Copies `seq`'s computed pages past its cached ones to host slots (None if it has none or
    the tier cannot hold them all); the caller then frees its pages as usual."""
    first, end = seq.num_cached_pages, -(-seq.num_computed_tokens // page_size)
    pages = [p for table in tables for p in table[first:end] if p != NULL_PAGE]
    slots = host.swap_out(pages) if pages else None
    if slots is None:
        return None
    taken = iter(slots)
    swapped = tuple(tuple(NULL_PAGE if p == NULL_PAGE else -next(taken) - 1 for p in t[first:end]) for t in tables)
    return SwappedKV(seq.num_computed_tokens, first, swapped, host.epoch)


def swap_if_cheaper(
    host: HostTier, cost: SwapCost, tables: list[list[int]], seq: KVSequence, page_size: int
) -> SwappedKV | None:
    """swap_out where `cost` prices moving the uncached computed pages below recomputing them."""
    uncached = seq.num_computed_tokens - seq.num_cached_pages * page_size
    end = -(-seq.num_computed_tokens // page_size)
    num_pages = sum(p != NULL_PAGE for t in tables for p in t[seq.num_cached_pages : end])
    if uncached > 0 and cost.swap_is_cheaper(num_pages, uncached):
        return swap_out(host, tables, seq, page_size)
    return None


def with_swap(host: HostTier, prefix: ComputedPrefix, seq: KVSequence, page_size: int) -> ComputedPrefix:
    """The prefix hit of a sequence holding swapped pages: its cached part cut to the pages the
    swap starts at, then the swapped ones up to its last token but one. A swap that cannot
    follow the hit (the cached pages before it are gone, or new weights came) is dropped."""
    swap = seq.swap
    if swap is None:
        return prefix
    num_tokens = min(swap.num_tokens, seq.num_tokens - 1)
    usable = swap.epoch == host.epoch and len(prefix.pages) >= swap.first_page
    if not usable or num_tokens <= swap.first_page * page_size:
        drop_swap(host, seq)
        return prefix
    end = -(-num_tokens // page_size) - swap.first_page
    cached = prefix.tables if prefix.pages else tuple(() for _ in swap.tables)
    tables = [c[: swap.first_page] + s[:end] for c, s in zip(cached, swap.tables)]
    return dataclasses.replace(
        prefix,
        pages=tables[0],
        num_tokens=num_tokens,
        group_pages=tuple(tables[1:]),
        num_swapped=end,
        swapped_tokens=num_tokens - swap.first_page * page_size,
        swap_slots=tuple(swap.slots),
    )


def drop_swap(host: HostTier | None, seq: KVSequence) -> None:
    """Gives the sequence's swapped slots back (it finished, or they cannot be used)."""
    if seq.swap is not None and host is not None:
        host.release_swapped(seq.swap.slots)
    seq.swap = None
