"""A sequence as the KV cache manager sees it (the KVSequence protocol), for the kv tests."""

from __future__ import annotations

import dataclasses

from jaxinfer.kv import KVCacheManager


@dataclasses.dataclass
class Seq:
    token_ids: list[int]
    num_computed_tokens: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    group_pages: list[list[int]] = dataclasses.field(default_factory=list)
    page_hashes: list = dataclasses.field(default_factory=list)
    num_cached_pages: int = 0
    num_host_hit_tokens: int = 0
    hash_root: bytes | None = None
    adapter: str | None = None
    swap: object = None  # kv.swap.SwappedKV while preempted with its pages swapped out
    received: object = None  # kv.prefix.ReceivedKV: pages pulled from another engine
    num_pending: int = 0  # trailing tokens not known yet (steps in flight)
    cacheable: int | None = None  # what cacheable_pages answers

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        return len(self.token_ids) - self.num_pending

    def cacheable_pages(self, page_size: int) -> int | None:
        return self.cacheable


def compute(kv: KVCacheManager, seq: Seq, num_tokens: int | None = None) -> None:
    """What a step does to a sequence: pages for its tokens up to `num_tokens` (all by default),
    which count as computed once the step ran; full pages are cached."""
    num_tokens = seq.num_tokens if num_tokens is None else num_tokens
    assert kv.allocate(seq, num_tokens)
    seq.num_computed_tokens = num_tokens
    kv.cache_computed(seq)


def admit(kv: KVCacheManager, seq: Seq) -> None:
    """Admission of the whole sequence: its cached prefix, pages for the rest, all computed."""
    prefix = kv.computed_prefix(seq)
    assert kv.allocate(seq, seq.num_tokens, prefix)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_computed(seq)


def assert_all_free(kv: KVCacheManager) -> None:
    pool = kv.pool
    assert kv.num_free_pages == kv.num_usable_pages and kv.usage == 0.0
    assert sorted(pool.free_page_ids()) == list(range(1, pool.num_pages))
    assert all(pool.ref_count(p) == 0 for p in range(pool.num_pages))
