"""PagePool: the KV cache's pages on the host side -- free list, reference counts, prefix cache.

The KV cache is `num_pages` fixed-size pages of `page_size` token slots each. This module only
hands out page ids; the arrays live in the ModelRunner. Plain Python, no JAX.

Data flow:

    free list (OrderedDict, head = next to reuse) --allocate()--> a sequence's page list
    a sequence's page list --free()--> free list, refcount 0; the page keeps its cached hash
    full, computed pages --cache_pages()--> prefix cache: hash -> page id
    a new prompt --match_prefix()--> cached pages of its prefix --allocate(cached=...)--> refcount++

Rules that must hold:
- Page 0 is the null page: padding tokens write there and it is never handed out.
- A page is either referenced (refcount > 0, not in the free list) or free (refcount 0, in the
  free list). Free pages may still be in the prefix cache; they are reusable until evicted.
- Free list order: pages without a cached hash sit at the head (reused first, nothing to lose);
  cached pages are appended at the tail when freed, so the least recently used cached page is
  evicted first. `free()` takes a sequence's pages in order and releases them tail first, so a
  prompt's deep pages are evicted before the shared head of the prompt.
- Evicting a cached page (to reuse it) deletes its hash entry.
- A page's hash chains over the previous page's hash and its own token ids (sha256, truncated to
  16 bytes, same in every process). A lookup is confirmed against the tokens and parent hash stored
  with the entry, so even a colliding `hash_fn` cannot return a page holding other tokens.
- `match_prefix` never covers the last token of its input: a step must compute at least one token
  of a sequence to produce the logits it samples from. The rule lives here, with the lookup, so
  no caller can forget it.
- Only pages whose KV has been computed may be cached (the scheduler calls `cache_pages` after the
  step that wrote them). If two sequences computed the same page, the first one cached wins; the
  other page stays an ordinary, uncached page.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import struct
from typing import TYPE_CHECKING, Callable, Hashable, Sequence

if TYPE_CHECKING:
    from jaxinfer.core.sequence import Sequence as SequenceState

NULL_PAGE = 0

PageHash = Hashable
HashFn = Callable[[PageHash | None, tuple[int, ...]], PageHash]


def hash_page(parent: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """Chained page hash: sha256(parent hash, token ids as little-endian int64), 16 bytes."""
    h = hashlib.sha256(parent if parent is not None else b"\x00" * 16)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()[:16]


@dataclasses.dataclass
class _CacheEntry:
    page_id: int
    parent: PageHash | None
    token_ids: tuple[int, ...]


class OutOfPagesError(RuntimeError):
    """allocate() was asked for more pages than are free; callers check can_allocate() first."""


class PagePool:
    def __init__(self, num_pages: int, page_size: int, *, enable_prefix_caching: bool = True,
                 hash_fn: HashFn = hash_page):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: need at least 2 (page 0 is the null page)")
        if page_size < 1:
            raise ValueError(f"page_size={page_size} must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self._ref_counts = [0] * num_pages
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict(
            (p, None) for p in range(1, num_pages))
        self._cache: dict[PageHash, _CacheEntry] = {}   # page hash -> entry
        self._page_hash: dict[int, PageHash] = {}        # page id -> its hash, while cached
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0     # of those, tokens served from the cache

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
        return len(self._cache)

    @property
    def usage(self) -> float:
        """Fraction of usable pages referenced by some sequence."""
        return 1.0 - self.num_free_pages / self.num_usable_pages

    @property
    def prefix_cache_hit_rate(self) -> float:
        queries = self.prefix_cache_queries
        return self.prefix_cache_hits / queries if queries else 0.0

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Counted by the scheduler once per admission (not per failed attempt)."""
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    def ref_count(self, page_id: int) -> int:
        return self._ref_counts[page_id]

    def free_page_ids(self) -> list[int]:
        """The free list in reuse order (head first); for tests and debugging."""
        return list(self._free)

    def is_cached(self, page_id: int) -> bool:
        return page_id in self._page_hash

    # --- hashing and lookup -----------------------------------------------------------------------
    def extend_page_hashes(self, hashes: list[PageHash], token_ids: Sequence[int]) -> None:
        """Appends to `hashes` the chained hash of every full page of `token_ids` not hashed yet."""
        ps = self.page_size
        for i in range(len(hashes), len(token_ids) // ps):
            parent = hashes[i - 1] if i else None
            hashes.append(self.hash_fn(parent, tuple(token_ids[i * ps:(i + 1) * ps])))

    def match_prefix(self, hashes: Sequence[PageHash], token_ids: Sequence[int]) -> list[int]:
        """Cached pages holding the longest full-page prefix of `token_ids[:-1]` (no side effects).

        `hashes` are the page hashes of `token_ids` (see extend_page_hashes). The last token is
        never matched: the step must compute it to produce logits.
        """
        if not self.enable_prefix_caching:
            return []
        ps = self.page_size
        max_pages = min(len(hashes), (len(token_ids) - 1) // ps)
        pages: list[int] = []
        for i in range(max_pages):
            entry = self._cache.get(hashes[i])
            parent = hashes[i - 1] if i else None
            if (entry is None or entry.parent != parent
                    or entry.token_ids != tuple(token_ids[i * ps:(i + 1) * ps])):
                break
            pages.append(entry.page_id)
        return pages

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    def cache_computed_pages(self, seq: SequenceState) -> None:
        """Registers the pages of `seq` full of computed tokens whose ids are all known
        (placeholders of steps in flight are not)."""
        num_full = min(seq.num_computed_tokens, seq.num_known_tokens) // self.page_size
        if not self.enable_prefix_caching or num_full <= seq.num_cached_pages:
            return
        known = seq.token_ids[:seq.num_known_tokens]
        self.extend_page_hashes(seq.page_hashes, known)
        self.cache_pages(seq.pages, seq.page_hashes, known, seq.num_cached_pages, num_full)
        seq.num_cached_pages = num_full

    def cache_pages(self, page_ids: Sequence[int], hashes: Sequence[PageHash],
                    token_ids: Sequence[int], start: int, stop: int) -> None:
        """Caches full pages `page_ids[start:stop]` of `token_ids` once their KV has been written.

        `hashes` are the page hashes of `token_ids` (at least `stop` of them).
        """
        if not self.enable_prefix_caching:
            return
        ps = self.page_size
        for i in range(start, stop):
            page_id, page_hash = page_ids[i], hashes[i]
            if page_id in self._page_hash or page_hash in self._cache:
                continue  # already cached (a prefix hit), or the same content cached elsewhere
            self._cache[page_hash] = _CacheEntry(page_id, hashes[i - 1] if i else None,
                                                 tuple(token_ids[i * ps:(i + 1) * ps]))
            self._page_hash[page_id] = page_hash

    # --- allocation -------------------------------------------------------------------------------
    def can_allocate(self, num_new: int, cached: Sequence[int] = ()) -> bool:
        """Whether allocate(num_new, cached) would succeed: cached pages that are free count too."""
        num_revived = sum(1 for p in cached if self._ref_counts[p] == 0)
        return num_new + num_revived <= len(self._free)

    def allocate(self, num_new: int, cached: Sequence[int] = ()) -> list[int]:
        """Takes a reference on each `cached` page, then hands out `num_new` fresh pages.

        Returns cached + fresh page ids, in that order. Fresh pages come from the head of the free
        list; a cached page taken that way loses its hash (evicted).
        """
        if not self.can_allocate(num_new, cached):
            raise OutOfPagesError(f"asked for {num_new} new pages (+{len(cached)} cached), "
                                  f"{len(self._free)} free")
        for p in cached:
            if self._ref_counts[p] == 0:
                del self._free[p]
            self._ref_counts[p] += 1
        fresh = []
        for _ in range(num_new):
            p, _ = self._free.popitem(last=False)
            self._evict(p)
            self._ref_counts[p] = 1
            fresh.append(p)
        return list(cached) + fresh

    def free(self, page_ids: Sequence[int]) -> None:
        """Drops one reference on each page, tail first; unreferenced pages join the free list."""
        for p in reversed(page_ids):
            if p == NULL_PAGE or self._ref_counts[p] <= 0:
                raise ValueError(f"page {p} freed but not allocated")
            self._ref_counts[p] -= 1
            if self._ref_counts[p] == 0:
                self._free[p] = None
                if p not in self._page_hash:  # nothing worth keeping: reuse it first
                    self._free.move_to_end(p, last=False)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached hash (e.g. after new weights are loaded); pages stay put."""
        self._cache.clear()
        self._page_hash.clear()

    def _evict(self, page_id: int) -> None:
        page_hash = self._page_hash.pop(page_id, None)
        if page_hash is not None:
            del self._cache[page_hash]
