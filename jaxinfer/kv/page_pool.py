"""PagePool: the KV cache's pages on the host side -- free list, reference counts, prefix cache.

The KV cache is `num_pages` fixed-size pages of `page_size` token slots each. This module only
hands out page ids; the arrays live in the worker. Plain Python, no JAX. The scheduler never
calls it directly: it talks to the KVCacheManager (manager.py), which owns a pool.

Data flow:

    free list (OrderedDict, head = next to reuse) --allocate()--> a sequence's page list
    a sequence's page list --free()--> free list, refcount 0; the page keeps its cached hash
    full, computed pages --cache_pages()--> prefix cache: hash -> page id (prefix_cache.py)
    a new prompt --match_prefix()--> cached pages of its prefix --allocate(cached=...)--> refcount++
    a cached page taken from the free list --> evicted: on_evict(page, hash), BlockRemoved event,
                                               and kept in the host tier if there is one
                                               (host_tier.py; a lookup then finds it there)

Rules that must hold:
- Page 0 is the null page: padding tokens write there and it is never handed out.
- A page is either referenced (refcount > 0, not in the free list) or free (refcount 0, in the
  free list). Free pages may still be in the prefix cache; they are reusable until evicted.
- Free list order: pages without a cached hash sit at the head (reused first, nothing to lose);
  cached pages are appended at the tail when freed, so the least recently used cached page is
  evicted first. `free()` takes a sequence's pages in order and releases them tail first, so a
  prompt's deep pages are evicted before the shared head of the prompt.
- Evicting a cached page (to reuse it) deletes its hash entry. `on_evict` hears of it first: a
  second tier (host memory) can copy the page out before the step that overwrites it runs.
- Layer groups (groups.py) share the pool, each with a prefix cache of its own (`cache`: the
  group's index): the same tokens computed for two groups are two pages, found each in its own
  group's cache. Events and `on_evict` speak of group 0's pages only (the first group: a
  full-attention one where the model has any), so a router sees one page per prefix page.
- A page's hash chains over the previous page's hash and its own token ids (sha256, truncated to
  16 bytes, same in every process). A lookup is confirmed against the tokens and parent hash stored
  with the entry, so even a colliding `hash_fn` cannot return a page holding other tokens.
- `match_prefix` never covers the last token of its input: a step must compute at least one token
  of a sequence to produce the logits it samples from. The rule lives here, with the lookup, so
  no caller can forget it.
- Only pages whose KV has been computed may be cached (the manager's `cache_computed` runs after
  the step that wrote them). If two sequences computed the same page, the first one cached wins;
  the other page stays an ordinary, uncached page.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

from jaxinfer.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from jaxinfer.kv.host_tier import HostTier
from jaxinfer.kv.prefix_cache import CacheEntry, HashFn, PageHash, PrefixCache, extend_page_hashes, hash_page

NULL_PAGE = 0

EvictListener = Callable[[int, PageHash], None]  # (page id, its hash) before the page is reused


class OutOfPagesError(RuntimeError):
    """allocate() was asked for more pages than are free; callers check can_allocate() first."""


class PagePool:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        enable_prefix_caching: bool = True,
        hash_fn: HashFn = hash_page,
        enable_events: bool = False,
        on_evict: EvictListener | None = None,
        num_caches: int = 1,
        host: HostTier | None = None,
    ):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: need at least 2 (page 0 is the null page)")
        if page_size < 1:
            raise ValueError(f"page_size={page_size} must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.on_evict = on_evict
        self.host = host
        self._ref_counts = [0] * num_pages
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict((p, None) for p in range(1, num_pages))
        self._caches = [PrefixCache() for _ in range(num_caches)]  # one per layer group
        self._events: list[KVEvent] | None = [] if enable_events else None
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # of those, tokens served from the cache
        self.prefix_cache_host_hits = 0  # of those, tokens whose pages came from the host tier

    # --- counters -------------------------------------------------------------------------------
    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        """Pages that allocate() can hand out (including cached pages nobody references)."""
        return len(self._free)

    @property
    def num_cached_pages(self) -> int:
        return sum(len(c) for c in self._caches)

    @property
    def usage(self) -> float:
        """Fraction of usable pages referenced by some sequence."""
        return 1.0 - self.num_free_pages / self.num_usable_pages

    @property
    def prefix_cache_hit_rate(self) -> float:
        queries = self.prefix_cache_queries
        return self.prefix_cache_hits / queries if queries else 0.0

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int, num_host_tokens: int = 0) -> None:
        """Counted once per admission (not per failed attempt); `num_host_tokens` of the hit came
        from the host tier."""
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens
        self.prefix_cache_host_hits += num_host_tokens

    def ref_count(self, page_id: int) -> int:
        return self._ref_counts[page_id]

    def free_page_ids(self) -> list[int]:
        """The free list in reuse order (head first); for tests and debugging."""
        return list(self._free)

    def is_cached(self, page_id: int) -> bool:
        return any(page_id in c for c in self._caches)

    def take_events(self) -> list[KVEvent]:
        """The KV events recorded since the last call, oldest first (events.py)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    # --- hashing and lookup -----------------------------------------------------------------------
    def extend_page_hashes(
        self, hashes: list[PageHash], token_ids: Sequence[int], root: PageHash | None = None
    ) -> None:
        """Appends to `hashes` the chained hash of every full page of `token_ids` not hashed yet,
        chained from `root` (prefix_cache.extend_page_hashes)."""
        extend_page_hashes(hashes, token_ids, self.page_size, self.hash_fn, root)

    def cached_page(
        self, index: int, hashes: Sequence[PageHash], token_ids: Sequence[int], cache: int = 0
    ) -> int | None:
        """The page in group `cache`'s prefix cache holding page `index` of `token_ids`
        (confirmed); else, with a host tier, -(slot + 1) where the host tier holds it; else None."""
        ps = self.page_size
        parent, tokens = hashes[index - 1] if index else None, token_ids[index * ps : (index + 1) * ps]
        page = self._caches[cache].lookup(hashes[index], parent, tokens)
        if page is None and self.host is not None:
            slot = self.host.lookup(cache, hashes[index], parent, tokens)
            return None if slot is None else -(slot + 1)
        return page

    def match_prefix(
        self, hashes: Sequence[PageHash], token_ids: Sequence[int], max_pages: int | None = None, cache: int = 0
    ) -> list[int]:
        """Cached pages holding the longest full-page prefix of `token_ids[:-1]` (no side effects),
        at most `max_pages` of them.

        `hashes` are the page hashes of `token_ids` (see extend_page_hashes). The last token is
        never matched: the step must compute it to produce logits.
        """
        if not self.enable_prefix_caching:
            return []
        limit = min(len(hashes), (len(token_ids) - 1) // self.page_size)
        pages: list[int] = []
        for i in range(limit if max_pages is None else min(limit, max_pages)):
            page = self.cached_page(i, hashes, token_ids, cache)
            if page is None:
                break
            pages.append(page)
        return pages

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    def cache_pages(
        self,
        page_ids: Sequence[int],
        hashes: Sequence[PageHash],
        token_ids: Sequence[int],
        start: int,
        stop: int,
        cache: int = 0,
        lora_name: str | None = None,
    ) -> None:
        """Caches full pages `page_ids[start:stop]` of `token_ids` (a page table of group
        `cache`) once their KV has been written; `lora_name`: the adapter they were computed
        under (their events say so).

        `hashes` are the page hashes of `token_ids` (at least `stop` of them). Null entries (pages
        a sliding window gave back) are skipped.
        """
        if not self.enable_prefix_caching:
            return
        ps, prefix_cache = self.page_size, self._caches[cache]
        stored = []
        for i in range(start, stop):
            page_id, page_hash = page_ids[i], hashes[i]
            if page_id == NULL_PAGE or page_id in prefix_cache or prefix_cache.holds_hash(page_hash):
                continue  # given back, already cached (a prefix hit), or the same content elsewhere
            prefix_cache.insert(
                page_hash, CacheEntry(page_id, hashes[i - 1] if i else None, tuple(token_ids[i * ps : (i + 1) * ps]))
            )
            stored.append(i)
        if stored and self._events is not None and cache == 0:
            self._record_stored(stored, hashes, token_ids, lora_name)

    def enable_events(self) -> None:
        """Starts recording KV events (a consumer will drain them: take_events)."""
        self._events = self._events if self._events is not None else []

    def _record_stored(
        self, indices: list[int], hashes: Sequence[PageHash], token_ids: Sequence[int], lora_name: str | None
    ) -> None:
        """One BlockStored per run of consecutive page indices."""
        if self._events is None:  # the caller records only with events on
            return
        ps, runs = self.page_size, [[indices[0]]]
        for i in indices[1:]:
            if i == runs[-1][-1] + 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, last = run[0], run[-1]
            self._events.append(
                BlockStored(
                    tuple(hashes[first : last + 1]),
                    hashes[first - 1] if first else None,
                    tuple(token_ids[first * ps : (last + 1) * ps]),
                    ps,
                    lora_name,
                )
            )

    # --- allocation -------------------------------------------------------------------------------
    def can_allocate(self, num_new: int, cached: Sequence[int] = ()) -> bool:
        """Whether allocate(num_new, cached) would succeed: cached pages that are free count too."""
        num_revived = sum(1 for p in cached if self._ref_counts[p] == 0)
        return num_new + num_revived <= len(self._free)

    def allocate(self, num_new: int, cached: Sequence[int] = ()) -> list[int]:
        """Takes a reference on each `cached` page, then hands out `num_new` fresh pages.

        Returns cached + fresh page ids, in that order. Fresh pages come from the head of the free
        list; a cached page taken that way loses its hash (evicted). `cached` may also name pages
        that are referenced already (a fork shares them): each gains one more reference.
        """
        if not self.can_allocate(num_new, cached):
            raise OutOfPagesError(f"asked for {num_new} new pages (+{len(cached)} cached), {len(self._free)} free")
        for p in cached:
            if self._ref_counts[p] == 0:
                del self._free[p]
            self._ref_counts[p] += 1
        fresh, evicted = [], []
        for _ in range(num_new):
            p, _ = self._free.popitem(last=False)
            for group, prefix_cache in enumerate(self._caches):
                removed = prefix_cache.remove(p)
                if removed is not None:
                    if self.host is not None:
                        self.host.store(group, *removed, p)
                    if group == 0:
                        if self.on_evict is not None:
                            self.on_evict(p, removed[0])
                        evicted.append(removed[0])
                    break
            self._ref_counts[p] = 1
            fresh.append(p)
        if evicted and self._events is not None:
            self._events.append(BlockRemoved(tuple(evicted)))
        return list(cached) + fresh

    def free(self, page_ids: Sequence[int]) -> None:
        """Drops one reference on each page, tail first; unreferenced pages join the free list."""
        for p in reversed(page_ids):
            if p == NULL_PAGE or self._ref_counts[p] <= 0:
                raise ValueError(f"page {p} freed but not allocated")
            self._ref_counts[p] -= 1
            if self._ref_counts[p] == 0:
                self._free[p] = None
                if not self.is_cached(p):  # nothing worth keeping: reuse it first
                    self._free.move_to_end(p, last=False)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached hash (e.g. after new weights are loaded); pages stay put."""
        for prefix_cache in self._caches:
            prefix_cache.clear()
        if self.host is not None:
            self.host.clear()
        if self._events is not None:
            self._events.append(AllBlocksCleared())
