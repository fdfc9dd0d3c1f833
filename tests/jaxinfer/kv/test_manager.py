"""KVCacheManager: exact page ids for admission with a prefix hit, allocation that fails with
nothing changed, tail-first release and LRU eviction, truncation and the counters."""

import pytest
from kv_support import Seq, admit, assert_all_free

from jaxinfer.kv import NO_PREFIX, ComputedPrefix, KVCacheManager


def test_admission_takes_the_computed_prefix_and_counts_the_hit():
    kv = KVCacheManager(10, 4)
    a = Seq(list(range(10)))  # 2 full pages + 2 tokens
    assert kv.computed_prefix(a) == NO_PREFIX and len(a.page_hashes) == 2  # nothing cached yet
    assert kv.allocate(a, 10, NO_PREFIX)
    assert a.pages == [1, 2, 3] and a.num_cached_pages == 0
    a.num_computed_tokens = 10
    kv.cache_computed(a)
    assert a.num_cached_pages == 2
    assert kv.pool.is_cached(1) and kv.pool.is_cached(2) and not kv.pool.is_cached(3)

    b = Seq(list(range(8)) + [50, 51, 52])
    prefix = kv.computed_prefix(b)
    assert prefix == ComputedPrefix((1, 2), 8)
    assert kv.allocate(b, 11, prefix)
    assert b.pages == [1, 2, 4] and b.num_cached_pages == 2
    assert [kv.pool.ref_count(p) for p in (1, 2, 3, 4)] == [2, 2, 1, 1]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (21, 8)
    assert kv.prefix_cache_hit_rate == pytest.approx(8 / 21)

    # never the last token: 8 tokens would end inside the second page, so only the first matches
    assert kv.computed_prefix(Seq(list(range(8)))) == ComputedPrefix((1,), 4)
    # a prompt being scored takes only the pages it scored (Sequence.cacheable_pages)
    assert kv.computed_prefix(Seq(list(range(10)), cacheable=1)) == ComputedPrefix((1,), 4)
    assert kv.computed_prefix(Seq(list(range(10)), cacheable=0)) == NO_PREFIX
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (21, 8)  # lookups alone count nothing

    kv.free(b)
    assert b.pages == [] and b.num_cached_pages == 0
    kv.free(a)
    assert kv.pool.free_page_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1]  # cached pages at the tail, head last
    assert_all_free(kv)


def test_prefix_caching_off_hashes_matches_and_caches_nothing():
    kv = KVCacheManager(10, 4, enable_prefix_caching=False)
    a = Seq(list(range(10)))
    admit(kv, a)
    assert a.page_hashes == [] and a.num_cached_pages == 0 and kv.pool.num_cached_pages == 0
    assert kv.computed_prefix(Seq(list(range(10)))) == NO_PREFIX
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10, 0)  # admissions still count
    kv.free(a)
    assert_all_free(kv)


def test_allocation_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(5, 2)  # pages 1-4
    a = Seq([1, 2, 3, 4, 5])
    admit(kv, a)
    assert a.pages == [1, 2, 3] and kv.pool.free_page_ids() == [4]
    # b shares a's two full pages; its 7 tokens need two pages more, and one is free
    b = Seq([1, 2, 3, 4, 9, 9, 9])
    prefix = kv.computed_prefix(b)
    assert prefix == ComputedPrefix((1, 2), 4)
    assert not kv.allocate(b, 7, prefix)
    assert b.pages == [] and b.num_cached_pages == 0 and kv.pool.free_page_ids() == [4]
    assert [kv.pool.ref_count(p) for p in (1, 2)] == [1, 1]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (5, 0)  # a failed attempt counts nothing
    assert kv.allocate(b, 6, prefix)  # a chunk of 6 fits
    assert b.pages == [1, 2, 4] and (kv.prefix_cache_queries, kv.prefix_cache_hits) == (12, 4)

    a.token_ids.append(6)
    assert kv.allocate(a, 6) and a.pages == [1, 2, 3]  # its page has room: nothing to do
    a.num_computed_tokens = 6
    a.token_ids.append(7)
    assert not kv.allocate(a, 7) and a.pages == [1, 2, 3]

    kv.free(b)
    assert kv.pool.free_page_ids() == [4]
    c = Seq([7, 7])
    assert not kv.allocate_all([(a, 7), (c, 2)])  # two pages, one free: neither gets one
    assert a.pages == [1, 2, 3] and c.pages == [] and kv.pool.free_page_ids() == [4]
    assert kv.allocate_all([(a, 7)]) and a.pages == [1, 2, 3, 4]
    kv.free(a)
    assert kv.pool.free_page_ids() == [3, 4, 2, 1]  # uncached pages reused first, last freed first

    # free cached pages that a prefix takes back count against the free pages too
    d = Seq([1, 2, 3, 4, 8, 8, 8, 8, 8])
    prefix = kv.computed_prefix(d)
    assert prefix == ComputedPrefix((1, 2), 4)
    assert not kv.allocate(d, 9, prefix)  # 2 cached + 3 fresh > 4
    assert d.pages == [] and kv.pool.free_page_ids() == [3, 4, 2, 1]
    assert kv.allocate(d, 8, prefix) and d.pages == [1, 2, 3, 4]
    kv.free(d)
    assert_all_free(kv)


def test_admission_with_a_prefix_is_for_a_sequence_without_pages():
    kv = KVCacheManager(5, 2)
    a = Seq([1, 2, 3])
    admit(kv, a)
    with pytest.raises(
        ValueError,
        match=r"allocate with a prefix is for admission, but the sequence "
        r"holds pages \[1, 2\]",
    ):
        kv.allocate(a, 4, NO_PREFIX)
    kv.free(a)


def test_freed_sequences_are_evicted_deepest_page_first_least_recently_used_first():
    kv = KVCacheManager(7, 2)  # pages 1-6
    a, b = Seq([1, 2, 3, 4, 5]), Seq([6, 7, 8, 9, 10])
    admit(kv, a)
    admit(kv, b)
    assert (a.pages, b.pages) == ([1, 2, 3], [4, 5, 6])
    kv.free(a)
    kv.free(b)
    # uncached pages first, then a's pages deepest first, then b's
    assert kv.pool.free_page_ids() == [6, 3, 2, 1, 5, 4]
    # a hit refreshes recency: a's first page, taken and freed again, moves behind b's pages
    again = Seq([1, 2, 3])
    admit(kv, again)
    assert again.pages == [1, 6]
    kv.free(again)
    assert kv.pool.free_page_ids() == [6, 3, 2, 5, 4, 1]
    c, d = Seq([11] * 5), Seq([12] * 3)
    admit(kv, c)
    admit(kv, d)
    assert (c.pages, d.pages) == ([6, 3, 2], [5, 4])  # a's second page goes, then b's pages
    assert kv.computed_prefix(Seq([1, 2, 3, 4, 5])) == ComputedPrefix((1,), 2)
    assert kv.computed_prefix(Seq([6, 7, 8, 9, 10])) == NO_PREFIX
    kv.free(c)
    kv.free(d)
    kv.reset_prefix_cache()
    assert kv.computed_prefix(Seq([1, 2, 3, 4, 5])) == NO_PREFIX and kv.pool.num_cached_pages == 0
    assert_all_free(kv)


def test_truncate_gives_back_the_pages_past_the_tokens():
    kv = KVCacheManager(9, 4)
    seq = Seq(list(range(6)))
    assert kv.allocate(seq, 11)  # the known tokens and 5 drafts
    assert seq.pages == [1, 2, 3]
    kv.truncate(seq, 7)
    assert seq.pages == [1, 2] and kv.pool.free_page_ids()[0] == 3
    kv.truncate(seq, 8)
    assert seq.pages == [1, 2]
    kv.free(seq)
    assert_all_free(kv)


def test_counters():
    kv = KVCacheManager(5, 2)
    assert kv.prefix_cache_hit_rate == 0.0 and kv.usage == 0.0 and kv.num_free_pages == kv.num_usable_pages == 4
    a = Seq([1, 2, 3])
    admit(kv, a)
    assert kv.usage == 0.5 and kv.num_free_pages == 2 and kv.pages_for(5) == 3
    kv.free(a)
    assert_all_free(kv)
