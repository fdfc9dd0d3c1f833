"""The page table on the device: the host mirror sends exactly the entries that changed, slots
are kept, reused least-recently-used first and cleared; the jitted scatter turns the device's
table into the mirror's; an engine's device table matches its mirror after every step, and a
decode that fills no new page sends nothing."""

import random

import jax
import numpy as np
import pytest
from testpaths import FIXTURES

from jaxinfer.config import EngineConfig
from jaxinfer.core.plan import ScheduledSeq
from jaxinfer.core.sequence import Sequence
from jaxinfer.engine import Engine
from jaxinfer.kv import NULL_PAGE
from jaxinfer.loader import load_model
from jaxinfer.sampling.params import SamplingParams
from jaxinfer.worker.page_table import (
    NULL_ROW,
    PageTableMirror,
    apply_updates,
    no_updates,
    padded_updates,
    update_widths,
)

PPS = 6  # pages per sequence


def _seq(seq_id):
    return Sequence(seq_id, f"r{seq_id}", [1], SamplingParams(), seed=0, arrival=seq_id)


def _entries(*table):
    """(sequence, pages) pairs -> plan entries (only the sequence and its pages are read)."""
    return [ScheduledSeq(seq, 0, 1, tuple(pages), sample=True) for seq, pages in table]


def _sent(changes):
    """(slot, col, page) of each entry set, of group 0 (the only one)."""
    assert not changes[3].any()
    return sorted(zip(*(c.tolist() for c in changes[:3])))


def test_only_changed_entries_are_sent_and_slots_are_kept():
    mirror, a, b = PageTableMirror(4, PPS), _seq(10), _seq(11)
    slots, changes = mirror.sync(_entries((a, [5, 6]), (b, [7])), s_bucket=4)
    assert slots.tolist() == [1, 2, NULL_ROW, NULL_ROW]
    assert _sent(changes) == [(1, 0, 5), (1, 1, 6), (2, 0, 7)]
    slots, changes = mirror.sync(_entries((b, [7]), (a, [5, 6])), s_bucket=2)  # same pages: nothing
    assert slots.tolist() == [2, 1] and _sent(changes) == []
    _, changes = mirror.sync(_entries((a, [5, 6, 9])), s_bucket=2)  # a decode starts a page
    assert _sent(changes) == [(1, 2, 9)]
    _, changes = mirror.sync(_entries((a, [5])), s_bucket=2)  # pages given back: cleared
    assert _sent(changes) == [(1, 1, NULL_PAGE), (1, 2, NULL_PAGE)]
    _, changes = mirror.sync(_entries((a, [8, 6, 4])), s_bucket=2)  # recomputed on other pages
    assert _sent(changes) == [(1, 0, 8), (1, 1, 6), (1, 2, 4)]
    assert mirror.page_rows(np.array([1, 2, 0])).tolist() == [[[8, 6, 4, 0, 0, 0], [7, 0, 0, 0, 0, 0], [0] * PPS]]


def test_each_layer_group_has_its_table_and_a_sequence_one_slot_in_all():
    mirror, a, b = PageTableMirror(3, PPS, num_groups=2), _seq(1), _seq(2)
    entries = [
        ScheduledSeq(a, 0, 9, (5, 6, 7), sample=True, group_pages=((0, 8, 9),)),
        ScheduledSeq(b, 0, 2, (3,), sample=True, group_pages=((4,),)),
    ]
    slots, changes = mirror.sync(entries, s_bucket=2)
    assert slots.tolist() == [1, 2]
    sent = sorted(zip(*(c.tolist() for c in changes)))  # (slot, col, page, group)
    assert sent == [(1, 0, 5, 0), (1, 1, 6, 0), (1, 1, 8, 1), (1, 2, 7, 0), (1, 2, 9, 1), (2, 0, 3, 0), (2, 0, 4, 1)]
    assert mirror.page_rows(slots)[:, :, :3].tolist() == [[[5, 6, 7], [3, 0, 0]], [[0, 8, 9], [4, 0, 0]]]
    updates = padded_updates([changes], update_widths(3, PPS, smallest=8, num_groups=2))
    table = apply_updates(jax.numpy.zeros((2, 3, PPS), jax.numpy.int32), updates)
    np.testing.assert_array_equal(np.asarray(table), mirror.rows)


def test_a_new_sequence_takes_the_least_recently_used_slot_outside_the_plan():
    mirror = PageTableMirror(3, PPS)  # two slots
    a, b, c = _seq(1), _seq(2), _seq(3)
    mirror.sync(_entries((a, [1, 2, 3])), s_bucket=2)
    mirror.sync(_entries((b, [4])), s_bucket=2)
    mirror.sync(_entries((b, [4])), s_bucket=2)  # a is now the least recently used
    slots, changes = mirror.sync(_entries((b, [4]), (c, [9])), s_bucket=2)
    assert slots.tolist() == [2, 1]  # c took a's slot; a's other entries are cleared
    assert _sent(changes) == [(1, 0, 9), (1, 1, NULL_PAGE), (1, 2, NULL_PAGE)]
    assert 1 not in mirror.slot_of and mirror.slot_of == {2: 2, 3: 1}
    mirror.sync(_entries((c, [9])), s_bucket=2)
    slots, changes = mirror.sync(_entries((a, [1, 2, 3])), s_bucket=2)  # a comes back: b's slot (LRU)
    assert slots.tolist() == [2, NULL_ROW] and _sent(changes) == [(2, 0, 1), (2, 1, 2), (2, 2, 3)]
    with pytest.raises(RuntimeError, match="3 sequences in one step, 2 page-table slots"):
        mirror.sync(_entries((a, [1]), (c, [9]), (b, [4])), s_bucket=4)


def test_update_widths_and_padding():
    assert update_widths(9, 100) == (64, 512, 4096)  # the last holds all 8 rows' 800 entries
    assert update_widths(2, 8) == (64,)
    assert update_widths(2, 8, num_groups=9) == (64, 512)
    assert padded_updates([(np.zeros(0, np.int32),) * 4], (64, 512)) is None
    one = (np.array([1, 2]), np.array([0, 3]), np.array([7, 8]), np.zeros(2, int))
    many = (np.arange(100), np.zeros(100, int), np.ones(100, int), np.zeros(100, int))
    stacked = padded_updates([one, many], (64, 512))  # two replicas: the larger count's width
    assert stacked.slots.shape == (2, 512)
    assert stacked.slots[0, :3].tolist() == [1, 2, 0] and stacked.pages[0, :3].tolist() == [7, 8, 0]
    assert stacked.pages[1, :101].tolist() == [1] * 100 + [0]


def test_the_device_table_follows_the_mirror_through_random_plans():
    """Sequences come and go, grow, give pages back and are recomputed on other pages; the
    scatter of each step's entries keeps the device's table equal to the mirror, and every
    plan sequence's row is exactly its pages."""
    rng, rows = random.Random(0), 5
    mirror = PageTableMirror(rows, PPS)
    widths = update_widths(rows, PPS, smallest=4)
    scatter = jax.jit(apply_updates, donate_argnums=(0,))
    table = jax.numpy.zeros((1, rows, PPS), jax.numpy.int32)
    seqs = {i: _seq(i) for i in range(9)}
    pages = {i: [] for i in seqs}
    for _ in range(60):
        chosen = rng.sample(sorted(seqs), rng.randint(1, rows - 1))
        for i in chosen:
            move = rng.random()
            if move < 0.5 and len(pages[i]) < PPS:
                pages[i].append(rng.randint(1, 40))
            elif move < 0.7:
                del pages[i][rng.randint(0, len(pages[i])) :]
            elif move < 0.8:
                pages[i] = [rng.randint(1, 40) for _ in range(rng.randint(0, PPS))]
        slots, changes = mirror.sync(_entries(*((seqs[i], pages[i]) for i in chosen)), s_bucket=rows)
        updates = padded_updates([changes], widths)
        if updates is not None:
            table = scatter(table, updates)
        np.testing.assert_array_equal(np.asarray(table), mirror.rows)
        for i, slot in zip(chosen, slots):
            assert np.asarray(table)[0, slot].tolist() == pages[i] + [NULL_PAGE] * (PPS - len(pages[i]))
        assert not np.asarray(table)[0, NULL_ROW].any()
    np.testing.assert_array_equal(np.asarray(scatter(table, no_updates(4))), mirror.rows)


@pytest.fixture(scope="module")
def engine():
    model = load_model(FIXTURES / "hf" / "llama3", dtype="float32")
    config = EngineConfig(
        num_pages=14,
        page_size=8,
        max_num_batched_tokens=32,
        max_num_seqs=3,
        max_model_len=128,
        token_buckets=(8, 32),
        num_decode_steps=4,
    )
    return Engine(model, config)


def test_the_engines_device_table_matches_its_mirror_after_every_step(engine, monkeypatch):
    """Five requests through three slots, a pool small enough to preempt: after each step the
    device's table is the mirror's; decode steps that start no page send no entries."""
    sent = []  # (decode-only step, entries sent)
    dispatch = engine.worker.step.dispatch

    def recording(inputs, num_steps=1):
        real = int(inputs.meta.num_seqs[0])
        decode = bool((np.diff(inputs.meta.cu_q_lens[: real + 1]) == 1).all())
        sent.append((decode, 0 if inputs.table is None else int((inputs.table.slots != 0).sum())))
        return dispatch(inputs, num_steps)

    monkeypatch.setattr(engine.worker.step, "dispatch", recording)
    compiled = engine.worker.num_compiled()
    for r in range(5):
        engine.add_request(
            [(r * 31 + i * 7) % 200 + 1 for i in range(20 + 9 * r)],
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            request_id=f"q{r}",
        )
    while engine.has_unfinished():
        engine.step()
        np.testing.assert_array_equal(
            np.asarray(engine.worker.step.page_table.array), engine.worker.step.inputs.tables[0].rows
        )
    assert engine.worker.num_compiled() == compiled, "the page table compiled a new variant"
    assert engine.num_preemptions > 0 and engine.kv_cache.num_free_pages == engine.kv_cache.num_usable_pages
    decodes = [n for decode, n in sent if decode]
    assert decodes.count(0) > len(decodes) // 2, sent  # a window of 4 starts a page of 8 every other time
    assert max(decodes) <= 3, sent  # at most one new page per sequence
