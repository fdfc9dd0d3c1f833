"""The prefix cache's hash chain and its map from page hashes to pages (plain Python).

A full page of a sequence is named by a chained hash over the previous page's hash and its own
token ids, so a page's hash stands for the whole prefix up to its end:

    token ids --extend_page_hashes()--> [h0, h1, ...]   h_i = hash_fn(h_{i-1}, tokens of page i)
    a computed page --PrefixCache.insert(h_i, ...)--> entry: page id, parent hash, token ids
    h_i of a new prompt --PrefixCache.lookup(...)--> the page, only if the entry's tokens and
                                                     parent are the prompt's (collisions miss)

A sequence's chain may start from a root of its own (`KVSequence.hash_root`: its LoRA adapter's,
fresh for each load of it) instead of nothing, so the same tokens computed under different
adapters hash apart and never share a page; the cache records the first page's parent as None
either way, and the root only changes what the hashes are.

`hash_page` is sha256 truncated to 16 bytes: the same in every process and on every host, so
page hashes can be compared across replicas (and published to routers as KV events).
The PagePool owns a PrefixCache and decides when pages enter and leave it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Callable, Hashable, Sequence
from typing import Any

PageHash = Hashable
# (the hash it made of the page before, None for the first; the page's token ids) -> the page's hash
HashFn = Callable[[Any, tuple[int, ...]], PageHash]


def hash_page(parent: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """Chained page hash: sha256(parent hash, token ids as little-endian int64), 16 bytes."""
    h = hashlib.sha256(parent if parent is not None else b"\x00" * 16)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()[:16]


def extend_page_hashes(
    hashes: list[PageHash],
    token_ids: Sequence[int],
    page_size: int,
    hash_fn: HashFn = hash_page,
    root: PageHash | None = None,
) -> None:
    """Appends to `hashes` the chained hash of every full page of `token_ids` not hashed yet.
    `root` stands before the first page (e.g. a LoRA adapter's: pages computed under different
    adapters never match); the cache still records the first page's parent as None."""
    for i in range(len(hashes), len(token_ids) // page_size):
        parent = hashes[i - 1] if i else root
        hashes.append(hash_fn(parent, tuple(token_ids[i * page_size : (i + 1) * page_size])))


@dataclasses.dataclass
class CacheEntry:
    page_id: int
    parent: PageHash | None
    token_ids: tuple[int, ...]


class PrefixCache:
    """Page hash -> the page holding that content, and page id -> its hash while cached."""

    def __init__(self) -> None:
        self._entries: dict[PageHash, CacheEntry] = {}
        self._page_hash: dict[int, PageHash] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, page_id: int) -> bool:
        return page_id in self._page_hash

    def lookup(self, page_hash: PageHash, parent: PageHash | None, token_ids: Sequence[int]) -> int | None:
        """The page cached under `page_hash`, if it holds exactly `token_ids` after `parent`."""
        entry = self._entries.get(page_hash)
        if entry is None or entry.parent != parent or entry.token_ids != tuple(token_ids):
            return None
        return entry.page_id

    def holds_hash(self, page_hash: PageHash) -> bool:
        return page_hash in self._entries

    def insert(self, page_hash: PageHash, entry: CacheEntry) -> None:
        self._entries[page_hash] = entry
        self._page_hash[entry.page_id] = page_hash

    def remove(self, page_id: int) -> tuple[PageHash, CacheEntry] | None:
        """Forgets the page's hash; returns it and its entry (None if the page was not cached)."""
        page_hash = self._page_hash.pop(page_id, None)
        if page_hash is None:
            return None
        return page_hash, self._entries.pop(page_hash)

    def clear(self) -> None:
        self._entries.clear()
        self._page_hash.clear()
