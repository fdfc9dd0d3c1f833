"""Copy-on-write forks: a child shares its parent's pages by reference count; the first of the
two to write into the shared partial page gets a fresh page and a (source, copy) pair."""

import pytest
from kv_support import Seq, admit, assert_all_free

from jaxinfer.kv import KVCacheManager


def forked_child(kv, parent):
    child = Seq(list(parent.token_ids), num_computed_tokens=parent.num_computed_tokens)
    kv.fork(parent, child)
    return child


def test_the_first_write_into_a_shared_partial_page_copies_it():
    kv = KVCacheManager(10, 4)
    parent = Seq(list(range(6)))
    admit(kv, parent)
    assert parent.pages == [1, 2] and parent.num_cached_pages == 1
    child = forked_child(kv, parent)
    assert child.pages == [1, 2] and [kv.pool.ref_count(p) for p in (1, 2)] == [2, 2]
    assert child.page_hashes == parent.page_hashes[:1] and child.num_cached_pages == 1
    assert kv.take_page_copies() == []

    child.token_ids.append(100)  # its 7th token goes into the shared page 2
    assert kv.allocate(child, 7)
    assert child.pages == [1, 3] and kv.take_page_copies() == [(2, 3)]
    assert [kv.pool.ref_count(p) for p in (1, 2, 3)] == [2, 1, 1]
    child.num_computed_tokens = 7

    parent.token_ids.append(200)  # page 2 is the parent's alone now: written in place
    assert kv.allocate(parent, 7) and parent.pages == [1, 2] and kv.take_page_copies() == []
    parent.num_computed_tokens = 7

    child.token_ids += [101, 102]  # into its own page 3, then a fresh page
    assert kv.allocate(child, 9) and child.pages == [1, 3, 4] and kv.take_page_copies() == []
    child.num_computed_tokens = 9
    kv.cache_computed(child)
    assert child.num_cached_pages == 2 and kv.pool.is_cached(3)  # [4, 5, 100, 101]
    kv.free(parent)
    kv.free(child)
    assert_all_free(kv)


def test_a_fork_at_a_page_boundary_shares_full_pages_only_and_copies_nothing():
    kv = KVCacheManager(10, 4)
    parent = Seq(list(range(8)))
    admit(kv, parent)
    child = forked_child(kv, parent)
    assert child.pages == [1, 2] and child.num_cached_pages == 2
    for seq in (child, parent):
        seq.token_ids.append(9)
        assert kv.allocate(seq, 9)
    assert (child.pages, parent.pages) == ([1, 2, 3], [1, 2, 4]) and kv.take_page_copies() == []
    kv.free(child)
    kv.free(parent)
    assert_all_free(kv)


def test_pages_past_the_computed_tokens_are_not_shared():
    kv = KVCacheManager(10, 4)
    parent = Seq(list(range(6)))
    assert kv.allocate(parent, 9)  # pages reserved for 9 tokens, 6 of them computed
    parent.num_computed_tokens = 6
    child = forked_child(kv, parent)
    assert parent.pages == [1, 2, 3] and child.pages == [1, 2]
    assert [kv.pool.ref_count(p) for p in (1, 2, 3)] == [2, 2, 1]
    kv.free(parent)
    kv.free(child)
    assert_all_free(kv)


def test_a_copy_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(3, 4)  # pages 1-2
    parent = Seq([1, 2, 3])
    admit(kv, parent)
    child = forked_child(kv, parent)
    other = Seq([9])
    admit(kv, other)
    child.token_ids.append(4)
    assert not kv.allocate(child, 4)
    assert child.pages == [1] and kv.pool.ref_count(1) == 2 and kv.take_page_copies() == []
    kv.free(other)
    assert kv.allocate(child, 4) and child.pages == [2] and kv.take_page_copies() == [(1, 2)]
    kv.free(child)
    kv.free(parent)
    assert_all_free(kv)


def test_fork_checks_the_child():
    kv = KVCacheManager(10, 4)
    parent = Seq(list(range(6)))
    admit(kv, parent)
    with pytest.raises(ValueError, match=r"the child's first 5 computed tokens are not the parent's 6"):
        kv.fork(parent, Seq(list(range(6)), num_computed_tokens=5))
    with pytest.raises(ValueError, match=r"the child's first 6 computed tokens are not the parent's 6"):
        kv.fork(parent, Seq([9] + list(range(1, 6)), num_computed_tokens=6))
    child = forked_child(kv, parent)
    with pytest.raises(ValueError, match=r"fork: the child holds pages \[1, 2\] already"):
        kv.fork(parent, child)
    kv.free(child)
    kv.free(parent)
    assert_all_free(kv)
