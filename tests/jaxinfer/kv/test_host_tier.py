"""The prefix cache's host tier: cached pages evicted from the device are offloaded to host slots
(exact page and slot ids), a prefix hit on them loads them back into fresh device pages (cached
there again), offloads of a plan come before its loads, the tier is LRU and never hands out a
slot a hit is being loaded from, each layer group keeps its own entries."""

import pytest
from kv_support import Seq, admit, assert_all_free

from jaxinfer.kv import ComputedPrefix, FullAttention, HostTier, KVCacheManager, SlidingWindow, SwapCost, SwappedKV


def test_evicted_pages_go_to_the_host_and_a_hit_loads_them_back():
    kv = KVCacheManager(5, 2, host_pages=4)  # device pages 1 .. 4
    a = Seq([0, 1, 2, 3, 4])
    admit(kv, a)  # pages [1, 2, 3]; 1 and 2 full, cached
    kv.free(a)
    b = Seq([9] * 8)
    admit(kv, b)  # takes 3, 4, then evicts 2 (a's page 1) and 1 (a's page 0) to host slots 0, 1
    assert b.pages == [3, 4, 2, 1]
    t = kv.take_transfers()
    assert (t.offloads, t.loads) == ([(2, 0), (1, 1)], [])
    kv.free(b)
    c = Seq([0, 1, 2, 3, 4, 7])
    prefix = kv.computed_prefix(c)
    assert prefix == ComputedPrefix((-2, -1), 4) and prefix.num_host_tokens == 4  # slots 1, 0
    assert kv.allocate(c, 6, prefix) and c.pages == [1, 2, 4]
    t = kv.take_transfers()
    # evicted for c: b's pages 3 (on 1), 2 (on 2) and 1 (on 4) -- the last into slot 2 again, the
    # least recently used one that no load of this plan reads; then the loads
    assert t.offloads == [(1, 2), (2, 3), (4, 2)] and t.loads == [(1, 1), (0, 2)]
    assert (kv.pool.prefix_cache_hits, kv.pool.prefix_cache_host_hits) == (4, 4)
    d = Seq([0, 1, 2, 3, 4, 8])
    assert kv.computed_prefix(d) == ComputedPrefix((1, 2), 4)  # loaded pages are cached on the device
    kv.free(c)
    assert_all_free(kv)
    assert kv.host.num_used == 4 and kv.host.num_stored == 5 and kv.host.num_loaded == 2


def test_the_host_tier_is_lru_and_keeps_pinned_slots():
    from jaxinfer.kv.prefix_cache import CacheEntry

    host = HostTier(2)
    host.store(0, b"a", CacheEntry(1, None, (1, 2)), 5)
    host.store(0, b"b", CacheEntry(2, None, (3, 4)), 6)
    assert host.lookup(0, b"a", None, (1, 2)) == 0  # a is now the most recently used
    assert host.lookup(0, b"a", None, (9, 9)) is None and host.lookup(1, b"a", None, (1, 2)) is None
    host.store(0, b"c", CacheEntry(3, None, (5, 6)), 7)  # evicts b (slot 1)
    assert host.lookup(0, b"b", None, (3, 4)) is None and host.lookup(0, b"c", None, (5, 6)) == 1
    host.pin([0, 1])
    host.store(0, b"d", CacheEntry(4, None, (7, 8)), 8)  # every slot pinned: d is not kept
    assert host.lookup(0, b"d", None, (7, 8)) is None
    t = host.take_transfers()
    assert t.offloads == [(5, 0), (6, 1), (7, 1)] and t.loads == []
    host.store(0, b"d", CacheEntry(4, None, (7, 8)), 8)  # unpinned once taken: a's slot (LRU) goes
    assert host.lookup(0, b"d", None, (7, 8)) == 0
    with pytest.raises(ValueError, match="a host tier of 0 pages holds no page"):
        HostTier(0)


def test_each_group_offloads_and_loads_its_own_pages():
    kv = KVCacheManager(9, 2, groups=[FullAttention(), SlidingWindow(3)], host_pages=8)
    a = Seq([0, 1, 2, 3, 4])
    admit(kv, a)  # pages [1, 2, 3] and [4, 5, 6]
    kv.free(a)
    admit(kv, filler := Seq([9] * 8))  # 8 pages: evicts every cached page of a
    assert filler.pages == [6, 3, 7, 8] and filler.group_pages == [[2, 1, 5, 4]]
    assert kv.take_transfers().offloads == [(2, 0), (1, 1), (5, 2), (4, 3)]  # full group's, then sliding
    kv.free(filler)
    c = Seq([0, 1, 2, 3, 4, 7])  # position 5 reads 3 .. 5: the sliding group needs its page 1 alone
    prefix = kv.computed_prefix(c)
    assert prefix == ComputedPrefix((-2, -1), 4, ((0, -3),))  # slots 1, 0 and 2
    assert kv.allocate(c, 6, prefix)
    t = kv.take_transfers()
    assert [slot for slot, _ in t.loads] == [1, 0, 2]
    assert (c.pages[:2], c.group_pages[0][:2]) == ([p for _, p in t.loads[:2]], [0, t.loads[2][1]])
    kv.free(c)
    assert_all_free(kv)


def _swapping(host_pages: int = 4, **kw) -> KVCacheManager:
    kv = KVCacheManager(6, 4, host_pages=host_pages, **kw)  # device pages 1 .. 5 of 4 tokens
    kv.swap_cost = SwapCost(transfer_s=1.0, width=64, token_s=1.0)  # one call beats 2+ tokens
    return kv


def test_a_preempted_sequence_swaps_its_uncached_pages_out_and_back():
    kv = _swapping()
    a = Seq(list(range(10)))
    admit(kv, a)  # pages [1, 2, 3]: 1 and 2 full and cached, 3 holds tokens 8, 9
    assert kv.preempt(a) and kv.num_swapped_preemptions == 1
    assert a.swap == SwappedKV(10, 2, ((-1,),), kv.host.epoch) and a.pages == []  # page 3 -> slot 0
    assert kv.take_transfers().offloads == [(3, 0)] and kv.host.num_swapped == 1
    a.token_ids.append(10)  # the token its last step sampled
    prefix = kv.computed_prefix(a)
    assert prefix.tables == ((1, 2, -1),) and prefix.num_tokens == 10 and prefix.num_cached_tokens == 8
    assert kv.allocate(a, 11, prefix) and a.pages == [1, 2, 3] and a.swap is None
    assert a.num_cached_pages == 2 and kv.pool.prefix_cache_hits == 8  # the swapped page is no hit
    t = kv.take_transfers()
    assert (t.offloads, t.loads) == ([], [(0, 3)]) and kv.host.num_swapped == 0
    assert kv.host.swap_out([4, 5, 1, 2]) == [0, 1, 2, 3]  # slot 0 free again once its load was taken
    kv.host.release_swapped([0, 1, 2, 3])
    kv.free(a)
    assert_all_free(kv)


def test_without_prefix_caching_every_computed_page_is_swapped():
    kv = _swapping(enable_prefix_caching=False)
    a = Seq(list(range(10)))
    admit(kv, a)
    assert kv.preempt(a) and a.swap.tables == ((-1, -2, -3),) and a.swap.first_page == 0
    assert kv.take_transfers().offloads == [(1, 0), (2, 1), (3, 2)]
    a.token_ids.append(10)
    assert kv.allocate(a, 11, kv.computed_prefix(a)) and a.pages == [1, 2, 3]
    assert kv.take_transfers().loads == [(0, 1), (1, 2), (2, 3)] and kv.pool.prefix_cache_hits == 0
    kv.free(a)
    assert_all_free(kv)


def test_swap_is_skipped_when_costlier_or_full_and_dropped_when_stale_or_finished():
    kv = _swapping()
    kv.swap_cost.token_s = 0.1  # a call costs more than 2 recomputed tokens
    a = Seq(list(range(10)))
    admit(kv, a)
    assert not kv.preempt(a) and a.swap is None and kv.take_transfers().offloads == []
    kv.swap_cost.token_s = 1.0
    b = Seq(list(range(100, 106)))  # pages 4, 5
    admit(kv, b)
    tiny = _swapping(host_pages=1, enable_prefix_caching=False)
    c = Seq(list(range(10)))
    admit(tiny, c)
    assert not tiny.preempt(c) and c.swap is None  # 3 pages, 1 slot: recomputed
    admit(kv, a)
    assert kv.preempt(a) and kv.host.num_swapped == 1
    kv.reset_prefix_cache()  # new weights: the swapped KV is stale
    a.token_ids.append(10)
    assert kv.computed_prefix(a).num_tokens == 0 and a.swap is None and kv.host.num_swapped == 0
    assert kv.preempt(b) and b.swap is not None
    kv.free(b)  # finished (aborted) while preempted: its slots come back
    assert b.swap is None and kv.host.num_swapped == 0
    kv.take_transfers()
    assert_all_free(kv)
