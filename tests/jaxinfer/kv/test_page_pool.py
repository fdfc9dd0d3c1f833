"""PagePool: exact page ids for allocation, freeing, prefix hits and LRU eviction."""

import hashlib
import struct
import subprocess
import sys

import pytest

from jaxinfer.kv.page_pool import NULL_PAGE, OutOfPagesError, PagePool
from jaxinfer.kv.prefix_cache import hash_page


@pytest.fixture
def make_pool():
    """Builds pools and, after the test, asserts every page is back in the free list."""
    pools = []

    def make(num_pages, page_size, **kw):
        pools.append(PagePool(num_pages, page_size, **kw))
        return pools[-1]

    yield make
    for pool in pools:
        assert_all_free(pool)


def assert_all_free(pool: PagePool):
    assert pool.num_free_pages == pool.num_usable_pages
    assert sorted(pool.free_page_ids()) == list(range(1, pool.num_pages))
    assert all(pool.ref_count(p) == 0 for p in range(pool.num_pages))
    assert pool.usage == 0.0


def hashes_of(pool, tokens):
    hashes = []
    pool.extend_page_hashes(hashes, tokens)
    return hashes


def test_allocate_in_order_and_free_returns_uncached_pages_to_the_head(make_pool):
    pool = make_pool(6, 4)
    assert pool.free_page_ids() == [1, 2, 3, 4, 5]
    assert pool.allocate(2) == [1, 2]
    assert pool.allocate(3) == [3, 4, 5]
    assert pool.num_free_pages == 0 and pool.usage == 1.0
    assert not pool.can_allocate(1)
    with pytest.raises(OutOfPagesError):
        pool.allocate(1)
    pool.free([1, 2])
    assert pool.free_page_ids() == [1, 2]
    pool.free([3, 4, 5])
    assert pool.free_page_ids() == [3, 4, 5, 1, 2]
    assert pool.allocate(1) == [3]
    assert pool.usage == pytest.approx(0.2)
    pool.free([3])


def test_null_page_is_never_handed_out_and_bad_frees_raise(make_pool):
    pool = make_pool(4, 2)
    pages = pool.allocate(3)
    assert NULL_PAGE not in pages
    with pytest.raises(ValueError, match="page 0"):
        pool.free([NULL_PAGE])
    pool.free(pages)
    with pytest.raises(ValueError, match="page 1 freed but not allocated"):
        pool.free([1])


def test_constructor_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_pages=1"):
        PagePool(1, 4)
    with pytest.raises(ValueError, match="page_size=0"):
        PagePool(4, 0)


def test_prefix_hit_takes_references_and_never_covers_the_last_token(make_pool):
    pool = make_pool(8, 4)
    tokens = list(range(10, 20))  # 10 tokens: 2 full pages + 2
    hashes = hashes_of(pool, tokens)
    assert len(hashes) == 2
    first = pool.allocate(3)
    assert first == [1, 2, 3]
    assert pool.match_prefix(hashes, tokens) == []  # nothing cached yet
    pool.cache_pages(first, hashes, tokens, 0, 2)
    assert pool.is_cached(1) and pool.is_cached(2) and not pool.is_cached(3)

    assert pool.match_prefix(hashes, tokens) == [1, 2]
    second = pool.allocate(1, cached=[1, 2])
    assert second == [1, 2, 4]
    assert [pool.ref_count(p) for p in (1, 2, 3, 4)] == [2, 2, 1, 1]

    # exactly 8 tokens: the second page would hold the last token, so only the first matches
    assert pool.match_prefix(hashes, tokens[:8]) == [1]
    # a different second page stops the match after the first
    other = tokens[:4] + [99] * 6
    assert pool.match_prefix(hashes_of(pool, other), other) == [1]
    # a different first page matches nothing, even with the same second page
    shifted = [99] + tokens[1:]
    assert pool.match_prefix(hashes_of(pool, shifted), shifted) == []

    pool.free(second)
    assert pool.free_page_ids() == [4, 5, 6, 7]
    pool.free(first)
    assert pool.free_page_ids() == [3, 4, 5, 6, 7, 2, 1]  # cached pages at the tail, head last
    # freed cached pages still hit, and taking them removes them from the free list
    assert pool.match_prefix(hashes, tokens) == [1, 2]
    assert pool.can_allocate(5, cached=[1, 2]) and not pool.can_allocate(6, cached=[1, 2])
    third = pool.allocate(1, cached=[1, 2])
    assert third == [1, 2, 3]
    assert pool.free_page_ids() == [4, 5, 6, 7]
    pool.free(third)


def test_lru_eviction_order_and_eviction_forgets_the_hash(make_pool):
    pool = make_pool(7, 2)
    a, b = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    ha, hb = hashes_of(pool, a), hashes_of(pool, b)
    pages_a = pool.allocate(3)
    pages_b = pool.allocate(3)
    assert (pages_a, pages_b) == ([1, 2, 3], [4, 5, 6])
    pool.cache_pages(pages_a, ha, a, 0, 2)
    pool.cache_pages(pages_b, hb, b, 0, 2)
    assert pool.num_cached_pages == 4
    pool.free(pages_a)
    pool.free(pages_b)
    # uncached pages first, then a's pages deepest first, then b's
    assert pool.free_page_ids() == [6, 3, 2, 1, 5, 4]

    assert pool.allocate(3) == [6, 3, 2]  # evicts page 2, a's second page
    assert pool.num_cached_pages == 3 and not pool.is_cached(2)
    assert pool.match_prefix(ha, a) == [1]
    assert pool.match_prefix(hb, b) == [4, 5]

    # a hit refreshes recency: a's page 1, taken and freed again, moves behind b's pages
    assert pool.free_page_ids() == [1, 5, 4]
    pool.free(pool.allocate(0, cached=[1]))
    assert pool.free_page_ids() == [5, 4, 1]
    assert pool.allocate(1) == [5]
    assert pool.match_prefix(hb, b) == [4]
    assert pool.match_prefix(ha, a) == [1]
    pool.free([6, 3, 2, 5])


def test_hash_collision_is_caught_by_the_stored_tokens(make_pool):
    pool = make_pool(6, 2, hash_fn=lambda parent, tokens: 0)
    a, b = [1, 2, 3], [4, 5, 6]
    ha, hb = hashes_of(pool, a), hashes_of(pool, b)
    assert ha == hb == [0]
    pages = pool.allocate(2)
    pool.cache_pages(pages, ha, a, 0, 1)
    assert pool.match_prefix(ha, a) == [1]
    assert pool.match_prefix(hb, b) == []
    # same hash, other content: the second page is not cached over the first
    other = pool.allocate(2)
    pool.cache_pages(other, hb, b, 0, 1)
    assert pool.is_cached(1) and not pool.is_cached(3)
    pool.free(pages)
    pool.free(other)


def test_same_content_computed_twice_keeps_the_first_page(make_pool):
    pool = make_pool(6, 2)
    tokens = [5, 6, 7]
    h = hashes_of(pool, tokens)
    first, second = pool.allocate(2), pool.allocate(2)
    pool.cache_pages(first, h, tokens, 0, 1)
    pool.cache_pages(second, h, tokens, 0, 1)
    assert pool.is_cached(1) and not pool.is_cached(3)
    assert pool.match_prefix(h, tokens) == [1]
    pool.free(second)
    pool.free(first)


def test_prefix_caching_off_matches_and_caches_nothing(make_pool):
    pool = make_pool(4, 2, enable_prefix_caching=False)
    tokens = [1, 2, 3, 4, 5]
    h = hashes_of(pool, tokens)
    pages = pool.allocate(3)
    pool.cache_pages(pages, h, tokens, 0, 2)
    assert pool.num_cached_pages == 0
    assert pool.match_prefix(h, tokens) == []
    pool.free(pages)


def test_counters_and_reset(make_pool):
    pool = make_pool(5, 2)
    assert pool.prefix_cache_hit_rate == 0.0
    pool.record_prefix_lookup(10, 4)
    pool.record_prefix_lookup(6, 0)
    assert (pool.prefix_cache_queries, pool.prefix_cache_hits) == (16, 4)
    assert pool.prefix_cache_hit_rate == 0.25
    tokens = [1, 2, 3]
    h = hashes_of(pool, tokens)
    pages = pool.allocate(2)
    pool.cache_pages(pages, h, tokens, 0, 1)
    pool.free(pages)
    pool.reset_prefix_cache()
    assert pool.num_cached_pages == 0 and pool.match_prefix(h, tokens) == []


def test_page_hash_is_chained_sha256_and_stable_across_processes():
    parent = hash_page(None, (1, 2))
    expected = hashlib.sha256(b"\x00" * 16 + struct.pack("<2q", 1, 2)).digest()[:16]
    assert parent == expected
    child = hash_page(parent, (3, 4))
    assert child != hash_page(None, (3, 4))
    code = "from jaxinfer.kv import hash_page; print(hash_page(hash_page(None, (1, 2)), (3, 4)).hex())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == child.hex()
