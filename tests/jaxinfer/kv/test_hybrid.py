"""Several layer groups over one page pool (a model mixing full and sliding-window layers): a
page table per group, pages from the shared pool, a step's pages all or none, the longest prefix
hit every group can use, copy-on-write in every group, events of group 0 alone; and which layers
form which group (config/kv_layout.py)."""

import pytest
from kv_support import Seq, admit, assert_all_free, compute

from jaxinfer.config import ModelConfig
from jaxinfer.config.kv_layout import kv_layout
from jaxinfer.config.sources import pattern_layer_types
from jaxinfer.kv import BlockStored, ComputedPrefix, FullAttention, KVCacheManager, SlidingWindow

HYBRID = [FullAttention(), SlidingWindow(3)]  # pages of 2: position p reads p - 2 .. p


def test_each_group_has_its_table_and_a_window_gives_pages_back():
    kv = KVCacheManager(12, 2, groups=HYBRID)
    seq = Seq(list(range(7)))
    compute(kv, seq, 4)
    assert (seq.pages, seq.group_pages) == ([1, 2], [[3, 4]])
    compute(kv, seq, 7)  # position 4 reads 2 .. 4: the sliding group's page 0 goes back (cached)
    assert (seq.pages, seq.group_pages) == ([1, 2, 5, 6], [[0, 4, 7, 8]])
    assert kv.pool.free_page_ids() == [9, 10, 11, 3] and kv.pool.is_cached(3)
    kv.free(seq)
    assert seq.group_pages == [] and kv.pool.free_page_ids()[:5] == [8, 6, 9, 10, 11]  # uncached first
    assert_all_free(kv)


def test_a_step_gets_pages_for_every_group_or_none():
    kv = KVCacheManager(5, 2, groups=HYBRID)  # 4 usable pages
    seq = Seq(list(range(6)))
    assert not kv.allocate(seq, 6)  # 3 + 3 pages
    assert (seq.pages, seq.group_pages, kv.num_free_pages) == ([], [[]], 4)
    assert kv.allocate(seq, 4) and (seq.pages, seq.group_pages) == ([1, 2], [[3, 4]])
    kv.free(seq)
    assert_all_free(kv)


def test_a_prefix_hit_is_the_longest_every_group_can_use():
    kv = KVCacheManager(24, 2, groups=HYBRID)
    a = Seq(list(range(9)))
    admit(kv, a)  # one pass: every page of both groups cached
    full, window = list(a.pages), list(a.group_pages[0])
    kv.free(a)
    b = Seq(list(range(9)) + [50])  # 4 full pages; position 8 reads 6 .. 8: the window's page 3 alone
    assert kv.computed_prefix(b) == ComputedPrefix(tuple(full[:4]), 8, ((0, 0, 0, window[3]),))
    kv.pool._caches[1].remove(window[3])  # the sliding group's page 3 evicted alone
    # 4 pages: the sliding group lacks page 3; 3 pages (position 6 reads 4 .. 6) need its page 2
    # alone, which it holds: a hit of 3 pages in both groups
    assert kv.computed_prefix(b) == ComputedPrefix(tuple(full[:3]), 6, ((0, 0, window[2]),))
    assert kv.allocate(b, 10, kv.computed_prefix(b))
    assert b.pages[:3] == full[:3] and b.group_pages[0][:3] == [0, 0, window[2]]
    kv.free(b)
    assert_all_free(kv)


def test_a_fork_copies_the_partial_page_of_every_group_once():
    kv = KVCacheManager(16, 2, groups=HYBRID)
    parent = Seq(list(range(5)))
    compute(kv, parent)  # pages [1, 2, 3] and [4, 5, 6]: the third of each partly filled
    child = Seq(list(range(5)), num_computed_tokens=5)
    kv.fork(parent, child)
    assert (child.pages, child.group_pages) == ([1, 2, 3], [[4, 5, 6]])
    child.token_ids.append(9)
    assert kv.allocate(child, 6)  # position 5 reads 3 .. 5: the window gives its page 0 back
    assert (child.pages, child.group_pages) == ([1, 2, 7], [[0, 5, 8]])
    assert kv.take_page_copies() == [(3, 7), (6, 8)]
    assert kv.pool.ref_count(4) == 1  # given back by the child, still the parent's
    kv.free(child)
    kv.free(parent)
    assert_all_free(kv)


def test_events_speak_of_group_zero_alone():
    kv = KVCacheManager(12, 2, groups=HYBRID, enable_events=True)
    seq = Seq(list(range(5)))
    compute(kv, seq)
    (stored,) = kv.take_events()
    assert isinstance(stored, BlockStored) and stored.token_ids == (0, 1, 2, 3)
    kv.free(seq)
    assert_all_free(kv)


def _config(num_layers: int, types: tuple[str, ...], window: int | None = 512) -> ModelConfig:
    return ModelConfig(
        family="gemma",
        model_type="gemma3_text",
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_layers=num_layers,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        sliding_window=window,
        layer_types=types,
    )


@pytest.mark.parametrize(
    ("num_layers", "period", "windows", "groups", "caches"),
    [
        (18, 6, (None,) + (512,) * 5, ((5, 11, 17), (0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16)), 3),
        (6, 2, (None, 512), ((1, 3, 5), (0, 2, 4)), 3),  # Gemma 2: alternating
        (8, 6, (None,) + (512,) * 7, ((5,), (0,), (1,), (2,), (3,), (4,), (6,), (7,)), 1),  # one global layer
        (9, 4, (None, 512, 512, 512, 512), ((3, 7), (0, 1), (2, 4), (5, 6), (8,)), 2),  # the last group short
    ],
)
def test_layers_form_groups_of_equal_size(num_layers, period, windows, groups, caches):
    layout = kv_layout(_config(num_layers, pattern_layer_types(num_layers, period)))
    assert (layout.windows, layout.groups, layout.num_caches) == (windows, groups, caches)
    seen = sorted(layer for g in layout.groups for layer in g)
    assert seen == list(range(num_layers))  # every layer in one group, at one cache
    assert all(len(g) <= caches for g in layout.groups)
    assert len({layout.slot(i) for i in range(num_layers)}) == num_layers


def test_layers_that_attend_alike_keep_a_cache_each():
    for types, window in [((), 16), (("full_attention",) * 4, None)]:
        layout = kv_layout(_config(4, types, window))
        assert (layout.windows, layout.groups, layout.num_caches) == ((window,), ((0, 1, 2, 3),), 4)
