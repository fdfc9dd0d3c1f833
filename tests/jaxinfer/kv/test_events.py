"""KV events (BlockStored / BlockRemoved / AllBlocksCleared) and the eviction listener."""

from kv_support import Seq, admit, assert_all_free

from jaxinfer.kv import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheManager, hash_page


def chain(token_ids, page_size):
    hashes = []
    for i in range(len(token_ids) // page_size):
        hashes.append(hash_page(hashes[-1] if hashes else None, tuple(token_ids[i * page_size : (i + 1) * page_size])))
    return hashes


def test_stored_removed_and_cleared_in_order():
    evicted = []
    kv = KVCacheManager(7, 2, enable_events=True, on_evict=lambda page, h: evicted.append((page, h)))
    a, b = Seq([1, 2, 3, 4, 5]), Seq([6, 7, 8, 9, 10])
    admit(kv, a)
    admit(kv, b)
    ha, hb = chain(a.token_ids, 2), chain(b.token_ids, 2)
    assert kv.take_events() == [
        BlockStored((ha[0], ha[1]), None, (1, 2, 3, 4), 2),
        BlockStored((hb[0], hb[1]), None, (6, 7, 8, 9), 2),
    ]
    assert kv.take_events() == []

    a.token_ids.append(6)  # a's third page fills: one more page, parent a's second
    assert kv.allocate(a, 6)
    a.num_computed_tokens = 6
    kv.cache_computed(a)
    assert kv.take_events() == [BlockStored((chain(a.token_ids, 2)[2],), ha[1], (5, 6), 2)]

    kv.free(a)
    kv.free(b)
    assert kv.pool.free_page_ids() == [6, 3, 2, 1, 5, 4]
    c = Seq([11] * 5)
    assert kv.allocate(c, 5, kv.computed_prefix(c))  # takes 6 (uncached), then evicts 3 and 2
    assert c.pages == [6, 3, 2]
    assert evicted == [(3, chain(a.token_ids, 2)[2]), (2, ha[1])]
    assert kv.take_events() == [BlockRemoved((chain(a.token_ids, 2)[2], ha[1]))]
    kv.reset_prefix_cache()
    assert kv.take_events() == [AllBlocksCleared()]
    kv.free(c)
    assert evicted == [(3, chain(a.token_ids, 2)[2]), (2, ha[1])]  # reset evicts nothing
    assert_all_free(kv)


def test_a_run_broken_by_a_page_cached_elsewhere_is_two_events():
    # a hash that ignores the parent: b's second page has the content, so the hash, of a's first
    kv = KVCacheManager(9, 2, enable_events=True, hash_fn=lambda parent, tokens: tokens)
    a = Seq([7, 7, 8])
    admit(kv, a)
    assert kv.take_events() == [BlockStored(((7, 7),), None, (7, 7), 2)]
    b = Seq([1, 1, 7, 7, 2, 2, 9])
    assert kv.allocate(b, 7, kv.computed_prefix(b))  # no hit: the parents differ
    b.num_computed_tokens = 7
    kv.cache_computed(b)
    assert kv.take_events() == [BlockStored(((1, 1),), None, (1, 1), 2), BlockStored(((2, 2),), (7, 7), (2, 2), 2)]
    kv.free(a)
    kv.free(b)
    assert_all_free(kv)


def test_events_are_off_unless_asked_for():
    kv = KVCacheManager(7, 2)
    a = Seq([1, 2, 3, 4, 5])
    admit(kv, a)
    kv.reset_prefix_cache()
    assert kv.take_events() == []
    kv.free(a)
