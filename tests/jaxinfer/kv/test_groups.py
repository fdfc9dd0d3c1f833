"""KV cache groups: a sliding window gives back the pages that fell out of it (null entries in
the page table) and takes a prefix hit from the cached pages its window needs alone."""

import pytest
from kv_support import Seq, admit, assert_all_free

from jaxinfer.kv import NO_PREFIX, BlockStored, ComputedPrefix, FullAttention, KVCacheManager, SlidingWindow


def test_pages_that_fell_out_of_the_window_go_back():
    # window 4, pages of 2: the token at position p reads p - 3 .. p
    kv = KVCacheManager(6, 2, groups=[SlidingWindow(4)])
    seq = Seq(list(range(6)))
    admit(kv, seq)
    assert seq.pages == [1, 2, 3] and seq.num_cached_pages == 3
    seq.token_ids.append(6)  # position 6 reads 3..6: page 0 (tokens 0, 1) is out
    assert kv.allocate(seq, 7)
    assert seq.pages == [0, 2, 3, 4]
    assert kv.pool.ref_count(1) == 0 and kv.pool.is_cached(1)  # free, still a prefix hit
    seq.num_computed_tokens = 7
    seq.token_ids.append(7)  # position 7 reads 4..7
    assert kv.allocate(seq, 8) and seq.pages == [0, 0, 3, 4]
    assert kv.pool.free_page_ids() == [5, 1, 2]
    kv.free(seq)  # null entries are skipped
    assert_all_free(kv)


def test_pages_given_back_count_toward_an_allocation_and_shared_ones_do_not():
    kv = KVCacheManager(5, 2, groups=[SlidingWindow(3)])  # position p reads p - 2 .. p
    a = Seq([1, 2, 3, 4, 5])
    admit(kv, a)
    b = Seq([1, 2, 3, 4, 9])  # position 4 reads 2..4: a's second page is all b needs
    prefix = kv.computed_prefix(b)
    assert prefix == ComputedPrefix((0, 2), 4)
    assert kv.allocate(b, 5, prefix) and b.pages == [0, 2, 4]
    assert kv.pool.ref_count(2) == 2 and kv.pool.free_page_ids() == []
    a.token_ids.append(6)
    assert kv.allocate(a, 6) and a.pages == [0, 2, 3]  # page 1 goes back
    a.num_computed_tokens = 6
    other = Seq([7])
    admit(kv, other)
    assert other.pages == [1]
    a.token_ids.append(7)  # page 2 leaves a's window, but b still reads it: nothing frees
    assert not kv.allocate(a, 7)
    assert a.pages == [0, 2, 3] and kv.pool.ref_count(2) == 2
    kv.free(other)
    assert kv.allocate(a, 7) and a.pages == [0, 0, 3, 1] and kv.pool.ref_count(2) == 1
    for seq in (a, b):
        kv.free(seq)
    assert_all_free(kv)


def test_a_full_pool_reuses_the_pages_the_window_gives_back():
    kv = KVCacheManager(4, 2, groups=[SlidingWindow(3)])  # pages 1-3
    seq = Seq([1, 2, 3, 4, 5, 6])
    admit(kv, seq)
    assert seq.pages == [1, 2, 3] and kv.num_free_pages == 0
    seq.token_ids.append(7)  # position 6 reads 4..6: pages 0 and 1 go back, the deeper first
    assert kv.allocate(seq, 7) and seq.pages == [0, 0, 3, 2]
    kv.free(seq)
    assert_all_free(kv)


def test_a_window_hit_needs_only_the_pages_the_window_reads():
    kv = KVCacheManager(9, 2, groups=[SlidingWindow(3)])
    full = KVCacheManager(9, 2, groups=[FullAttention()])
    for cache in (kv, full):
        a = Seq(list(range(9)))
        admit(cache, a)
        assert a.pages == [1, 2, 3, 4, 5]  # admission gives nothing back yet
        cache.free(a)
        assert cache.pool.free_page_ids() == [5, 6, 7, 8, 4, 3, 2, 1]
    # position 8 reads 6..8: page 3 (tokens 6, 7) alone
    assert kv.computed_prefix(Seq(list(range(9)) + [50])) == ComputedPrefix((0, 0, 0, 4), 8)
    assert full.computed_prefix(Seq(list(range(9)) + [50])) == ComputedPrefix((1, 2, 3, 4), 8)
    for cache in (kv, full):
        evict = Seq([60] * 10)
        assert cache.allocate(evict, 10) and evict.pages == [5, 6, 7, 8, 4]  # a's fourth page goes
        cache.free(evict)
    # the window falls back to the top of the shorter run below the evicted page
    assert kv.computed_prefix(Seq(list(range(9)) + [50])) == ComputedPrefix((0, 0, 3), 6)
    assert full.computed_prefix(Seq(list(range(9)) + [50])) == ComputedPrefix((1, 2, 3), 6)
    assert kv.computed_prefix(Seq([99] + list(range(1, 10)))) == NO_PREFIX  # another first page
    assert_all_free(kv)
    assert_all_free(full)


def test_a_window_hit_survives_an_evicted_head():
    kv = KVCacheManager(9, 2, groups=[SlidingWindow(3)])
    a = Seq(list(range(9)))
    admit(kv, a)
    kv.free(a)
    b = Seq(list(range(9)) + [50])
    admit(kv, b)  # the window's hit takes a's fourth page alone, and refreshes it
    assert b.pages == [0, 0, 0, 4, 5]
    kv.free(b)
    assert kv.pool.free_page_ids() == [6, 7, 8, 3, 2, 1, 5, 4]
    filler = Seq([70] * 12)
    assert kv.allocate(filler, 12) and filler.pages == [6, 7, 8, 3, 2, 1]  # a's first three pages go
    c = Seq(list(range(9)) + [60])
    assert kv.computed_prefix(c) == ComputedPrefix((0, 0, 0, 4), 8)
    assert kv.pool.match_prefix(c.page_hashes, c.token_ids) == []  # full attention would need page 1
    kv.free(filler)
    assert_all_free(kv)


def test_a_page_given_back_before_its_step_landed_is_cached_first():
    kv = KVCacheManager(6, 2, groups=[SlidingWindow(3)], enable_events=True)
    seq = Seq([1, 2, 3, 4, 5])
    assert kv.allocate(seq, 4)  # a step of 4 tokens is in flight: not cached yet
    seq.num_computed_tokens = 4
    assert kv.allocate(seq, 5)  # position 4 reads 2..4: page 0 goes back before cache_computed
    assert seq.pages == [0, 2, 3]  # saw it, so it is cached on the way and kept longest
    assert kv.pool.is_cached(1) and kv.pool.free_page_ids() == [4, 5, 1]
    seq.num_computed_tokens = 5
    kv.cache_computed(seq)
    assert kv.pool.is_cached(2) and seq.num_cached_pages == 2
    assert [type(e) for e in kv.take_events()] == [BlockStored, BlockStored]
    kv.free(seq)
    again = Seq([1, 2, 3, 4, 5, 6])  # position 5 reads 3..5: the hit needs page 1 (tokens 2, 3) alone
    assert kv.computed_prefix(again) == ComputedPrefix((0, 2), 4)
    assert_all_free(kv)


def test_a_window_must_hold_a_token():
    with pytest.raises(ValueError, match="sliding window=0 must be >= 1"):
        SlidingWindow(0)
