"""KVCacheManager: the scheduler's one door to the KV cache's pages (plain Python, no JAX).

The scheduler decides which sequences run and how many tokens each computes; the manager decides
which pages hold them. It owns a PagePool (free list, reference counts, prefix caches) and the
KVCacheGroups of the model's layers (how each group reads its pages), and writes a sequence's KV
fields: `pages` (group 0's page table), `group_pages` (the tables of groups 1 .. G-1),
`page_hashes` (chained hashes of its full pages, the same for every group) and
`num_cached_pages` (leading pages registered in the prefix caches). Nobody else writes them.

    admission   prefix = computed_prefix(seq)     cached pages of its prefix, never its last
                                                  token (no side effects)
                allocate(seq, n, prefix)           takes the prefix's pages, fresh ones up to n
    each step   allocate(seq, n)                   pages so that seq holds n tokens; False, with
                                                  nothing changed, if they do not fit
                allocate_all([(seq, n), ...])      all of them or none (a decode window)
    after it    cache_computed(seq)                pages full of computed, known tokens -> cache
    drafts      truncate(seq, n)                   gives back pages past n tokens (rejected drafts)
    the end     free(seq)                          every page back, tail first (finish)
                preempt(seq)                       free(seq), its uncached pages first swapped to
                                                  the host tier where `swap_cost` says that beats
                                                  recomputing them (swap.py)
    P/D         detach(seq) / free_tables(tables)  a prefill's pages held for another engine's pull
                receive(seq, pattern, n)           pages for KV pulled from another engine (prefix.py)

Several groups (a model mixing full and sliding-window layers, config/kv_layout.py): every call
acts on each group's table, a step's pages fit only if every group's do, and a prefix hit is the
longest prefix every group can use (a sliding-window group needs only its window's pages of it).
A sliding-window group gives back the pages no token from `num_computed_tokens` on reads again
(NULL_PAGE in its table) when it next allocates, so it holds at most the pages of its window and
the step's chunk.

Copy-on-write: fork(parent, child) lets a child share the pages that hold its parent's computed
tokens by reference count. Full pages are never written again, so sharing them is free; the
partial last page is written by both, so the first of the two to write into it gets a fresh
page, and the pair (shared page, fresh page) is queued: `take_page_copies()` hands the pairs to
the step, which must copy each page before any of its KV writes (steps run in order on the
device, so a page freed meanwhile is overwritten only after the copy read it).

The host tier hears of each cached page the pool evicts (`on_evict`); `take_events()` drains the
BlockStored / BlockRemoved / AllBlocksCleared events (events.py) for routers.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxinfer.kv.events import KVEvent
from jaxinfer.kv.groups import FullAttention, KVCacheGroup
from jaxinfer.kv.host_tier import HostTier, Transfers
from jaxinfer.kv.page_pool import NULL_PAGE, EvictListener, PagePool
from jaxinfer.kv.prefix import (
    NO_PREFIX,
    ComputedPrefix,
    KVSequence,
    ReceivedKV,
    longest_prefix,
    receive_pages,
    received_prefix,
    take_prefix,
)
from jaxinfer.kv.prefix_cache import HashFn, hash_page
from jaxinfer.kv.swap import SwapCost, drop_swap, swap_if_cheaper, with_swap
from jaxinfer.kv.tables import cache_released, num_freed_by, release, shared_write_page, skipped_range, untouched


class KVCacheManager:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        enable_prefix_caching: bool = True,
        groups: Sequence[KVCacheGroup] = (FullAttention(),),
        hash_fn: HashFn = hash_page,
        enable_events: bool = False,
        on_evict: EvictListener | None = None,
        host_pages: int = 0,
    ):
        if not groups:
            raise ValueError("a KV cache manager needs at least one layer group")
        self.host = HostTier(host_pages) if host_pages else None  # the prefix cache's host-memory tier
        self.pool = PagePool(
            num_pages,
            page_size,
            enable_prefix_caching=enable_prefix_caching,
            hash_fn=hash_fn,
            enable_events=enable_events,
            on_evict=on_evict,
            num_caches=len(groups),
            host=self.host,
        )
        self.page_size = page_size
        self.groups = tuple(groups)
        self._releases = [g.releases_pages for g in self.groups]
        self._windows = [getattr(g, "window", None) if g.releases_pages else None for g in self.groups]
        self._forked = False  # no partial page is shared before a fork: writes need no check
        self._copies: list[tuple[int, int]] = []
        self.swap_cost: SwapCost | None = None  # measured by the worker (none: preemption recomputes)
        self.num_swapped_preemptions = 0

    # --- metrics: the pool's ------------------------------------------------------------------
    enable_prefix_caching = property(lambda self: self.pool.enable_prefix_caching)
    num_usable_pages = property(lambda self: self.pool.num_usable_pages)
    num_free_pages = property(lambda self: self.pool.num_free_pages)
    usage = property(lambda self: self.pool.usage)
    prefix_cache_queries = property(lambda self: self.pool.prefix_cache_queries)
    prefix_cache_hits = property(lambda self: self.pool.prefix_cache_hits)
    prefix_cache_hit_rate = property(lambda self: self.pool.prefix_cache_hit_rate)

    def enable_events(self) -> None:
        """Records KV events from now on, for a consumer that drains them (take_events)."""
        self.pool.enable_events()

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    def take_transfers(self) -> Transfers:
        """The copies between device and host tier since the last call (host_tier.py): offloads
        of evicted pages, then loads of host pages a prefix hit takes, before the next step."""
        return self.host.take_transfers() if self.host is not None else Transfers()

    def take_page_copies(self) -> list[tuple[int, int]]:
        """(source page, destination page) pairs of copy-on-write, oldest first, since the last
        call; the step that uses the destinations copies them before its KV writes."""
        copies, self._copies = self._copies, []
        return copies

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    def tables(self, seq: KVSequence) -> list[list[int]]:
        """The sequence's page table of each group (the lists themselves: edits land in it)."""
        if len(seq.group_pages) != len(self.groups) - 1:
            if seq.pages or any(seq.group_pages):
                raise ValueError(f"{1 + len(seq.group_pages)} page tables for {len(self.groups)} layer groups")
            seq.group_pages = [[] for _ in self.groups[1:]]
        return [seq.pages, *seq.group_pages]

    # --- admission ------------------------------------------------------------------------------
    def computed_prefix(self, seq: KVSequence) -> ComputedPrefix:
        """Cached pages of the longest prefix of `seq` every group can use, never covering its
        last token (the step must compute it for logits) nor pages past `seq.cacheable_pages`;
        with a host tier, pages there count (negative entries: -(slot + 1), prefix.py)."""
        if seq.received is not None:  # pulled from another engine (disaggregated prefill/decode)
            return received_prefix(seq, self.page_size)
        prefix = longest_prefix(self.pool, self.groups, seq) if self.pool.enable_prefix_caching else NO_PREFIX
        if seq.swap is not None and self.host is not None:
            prefix = with_swap(self.host, prefix, seq, self.page_size)
        return prefix

    def _allocate_with_prefix(self, seq: KVSequence, num_tokens: int, prefix: ComputedPrefix) -> bool:
        if seq.pages or any(seq.group_pages):
            raise ValueError(f"allocate with a prefix is for admission, but the sequence holds pages {seq.pages}")
        taken = take_prefix(self.pool, seq, prefix, self.pages_for(num_tokens), len(self.groups))
        if taken and seq.received is not None:  # the received pages' own references: the table's now
            self.free_tables(seq.received.tables)
            seq.received = None
        return taken

    # --- each step ------------------------------------------------------------------------------
    def allocate(self, seq: KVSequence, num_tokens: int, prefix: ComputedPrefix | None = None) -> bool:
        """Gives `seq` pages for its first `num_tokens` tokens: a step computes the tokens from
        `seq.num_computed_tokens` to `num_tokens`. False, with nothing changed, if they do not
        fit. `prefix` (admission, from computed_prefix) puts the cached pages first and counts
        the lookup in the hit rate."""
        if prefix is not None:
            return self._allocate_with_prefix(seq, num_tokens, prefix)
        tables, ps = self.tables(seq), self.page_size
        if not self._forked and untouched(tables, self._windows, seq.num_computed_tokens, -(-num_tokens // ps), ps):
            return True  # the common decode step: its pages are there, none to give back
        edits: list[tuple[list[int], int, int, range | None]] = []
        need = freed = 0
        for table, releases in zip(tables, self._releases):
            new = -(-num_tokens // self.page_size) - len(table)
            shared = shared_write_page(self.pool, seq.num_computed_tokens, table, num_tokens) if self._forked else -1
            skipped = (
                skipped_range(self.groups[len(edits)], seq.num_computed_tokens, table, self.page_size)
                if releases
                else None
            )
            edits.append((table, max(new, 0) + (shared >= 0), shared, skipped))
            need += max(new, 0) + (shared >= 0)
            freed += num_freed_by(self.pool, table, skipped)
        if need > self.pool.num_free_pages + freed:
            return False
        for i, (table, new, shared, skipped) in enumerate(edits):
            if skipped:
                cache_released(self.pool, seq, table, skipped, i)
                release(self.pool, table, skipped)
            if shared >= 0:
                self._copy_on_write(table, shared)
                new -= 1
            if new:
                table += self.pool.allocate(new)
        return True

    def allocate_all(self, requests: Sequence[tuple[KVSequence, int]]) -> bool:
        """allocate(seq, num_tokens) for every pair, or for none if they do not all fit."""
        total = 0
        for seq, num_tokens in requests:
            for table in self.tables(seq):
                total += max(0, self.pages_for(num_tokens) - len(table))
                total += self._forked and shared_write_page(self.pool, seq.num_computed_tokens, table, num_tokens) >= 0
        if total > self.pool.num_free_pages:  # pages out of a sliding window only add to these
            return False
        for seq, num_tokens in requests:
            self.allocate(seq, num_tokens)
        return True

    def cache_computed(self, seq: KVSequence) -> None:
        """Registers the pages of `seq` full of computed tokens whose ids are all known
        (placeholders of steps in flight are not) in the prefix caches."""
        num_full = min(seq.num_computed_tokens, seq.num_known_tokens) // self.page_size
        if num_full <= seq.num_cached_pages or not self.pool.enable_prefix_caching:
            return
        known = seq.token_ids[: seq.num_known_tokens]
        self.pool.extend_page_hashes(seq.page_hashes, known, seq.hash_root)
        for i, table in enumerate(self.tables(seq)):
            self.pool.cache_pages(table, seq.page_hashes, known, seq.num_cached_pages, num_full, i, seq.adapter)
        seq.num_cached_pages = num_full

    def truncate(self, seq: KVSequence, num_tokens: int) -> None:
        """Gives back the pages past those that hold `num_tokens` tokens (rejected drafts)."""
        keep = self.pages_for(num_tokens)
        for table in self.tables(seq):
            if len(table) > keep:
                self.pool.free(table[keep:])
                del table[keep:]

    def free(self, seq: KVSequence) -> None:
        """Gives back every page of `seq` (free_tables) and any it swapped out or received."""
        drop_swap(self.host, seq)
        self.free_tables(self.detach(seq))
        if seq.received is not None:
            self.free_tables(seq.received.tables)
            seq.received = None

    def free_tables(self, tables: Sequence[Sequence[int]]) -> None:
        for table in tables:  # each tail first (pool.free): deep pages are evicted first
            self.pool.free([p for p in table if p != NULL_PAGE])

    # --- disaggregated prefill/decode -----------------------------------------------------------
    def detach(self, seq: KVSequence) -> list[list[int]]:
        """The sequence's page tables handed over, their pages still held (free_tables frees)."""
        tables = self.tables(seq)
        seq.pages, seq.group_pages, seq.num_cached_pages = [], [], 0
        return tables

    def receive(self, seq: KVSequence, pattern: Sequence[str], num_tokens: int) -> ReceivedKV | None:
        """Fresh pages laid out as `pattern` (per group: "1" a page, "0" none) for the first
        `num_tokens` tokens' KV another engine computed, held by `seq.received` till admission."""
        if len(pattern) != len(self.groups):
            raise ValueError(f"KV of {len(pattern)} layer groups for a pool of {len(self.groups)}")
        seq.received = receive_pages(self.pool, pattern, num_tokens)
        return seq.received

    def preempt(self, seq: KVSequence) -> bool:
        """free(seq), having first swapped its computed pages past the cached ones to the host
        tier if `swap_cost` prices that below recomputing them (swap.py); True if it did."""
        swap = None
        if self.host is not None and self.swap_cost is not None:
            swap = swap_if_cheaper(self.host, self.swap_cost, self.tables(seq), seq, self.page_size)
        self.free(seq)
        seq.swap = swap
        self.num_swapped_preemptions += swap is not None
        return swap is not None

    # --- copy-on-write --------------------------------------------------------------------------
    def fork(self, parent: KVSequence, child: KVSequence) -> None:
        """`child` shares the pages holding `parent`'s computed tokens. The caller gives the child
        the parent's tokens and num_computed_tokens first; the child holds no pages yet."""
        computed = parent.num_computed_tokens
        if child.pages or any(child.group_pages):
            raise ValueError(f"fork: the child holds pages {child.pages} already")
        if child.num_computed_tokens != computed or child.token_ids[:computed] != parent.token_ids[:computed]:
            raise ValueError(
                f"fork: the child's first {child.num_computed_tokens} computed tokens are not the parent's {computed}"
            )
        shared = [table[: self.pages_for(computed)] for table in self.tables(parent)]
        self.pool.allocate(0, [p for table in shared for p in table if p != NULL_PAGE])  # one more reference each
        num_full = computed // self.page_size
        child.pages, *child.group_pages = (list(table) for table in shared)
        child.page_hashes = parent.page_hashes[:num_full]
        child.num_cached_pages = min(parent.num_cached_pages, num_full)
        self._forked = True

    def _copy_on_write(self, table: list[int], index: int) -> None:
        source = table[index]
        (copy,) = self.pool.allocate(1)
        self.pool.free([source])  # still referenced by the sequence it is shared with
        table[index] = copy
        self._copies.append((source, copy))
