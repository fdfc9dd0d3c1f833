"""HeldFreesManager (pipeline stages with a batch in flight on each): pages freed while batches
are in flight go back to the pool `delay` launches later, or at once when nothing is in flight;
nothing else changes."""

from kv_support import Seq, assert_all_free

from jaxinfer.kv.held import HeldFreesManager


def test_freed_pages_wait_for_the_batches_in_flight():
    kv = HeldFreesManager(10, 4, delay=2)
    a, b = Seq(list(range(9))), Seq(list(range(100, 104)))
    assert kv.allocate(a, 9) and kv.allocate(b, 4)
    assert kv.num_free_pages == 5
    kv.free(a)  # three pages held: a batch launched before may still write them
    assert a.pages == [] and kv.num_held_pages == 3 and kv.num_free_pages == 5
    kv.launched()
    assert kv.num_free_pages == 5  # one launch: a batch from before is still in flight
    kv.free(b)  # held from launch 1
    kv.launched()
    assert kv.num_free_pages == 8 and kv.num_held_pages == 1  # a's back (2 launches), b's not yet
    kv.settle(busy=True)
    assert kv.num_held_pages == 1
    kv.settle(busy=False)  # nothing in flight: all back
    assert kv.num_held_pages == 0
    assert_all_free(kv)


def test_held_pages_are_not_handed_out_again():
    kv = HeldFreesManager(4, 4, delay=1)  # 3 usable pages
    a = Seq(list(range(12)))
    assert kv.allocate(a, 12)
    kv.free(a)
    assert not kv.allocate(Seq([1]), 1)  # every page held
    kv.launched()
    c = Seq([1])
    assert kv.allocate(c, 1) and c.pages[0] in (1, 2, 3)


def test_a_preempted_sequences_pages_come_back_at_once_and_admission_leaves_room_to_grow():
    kv = HeldFreesManager(8, 4, delay=3)  # 7 usable pages
    a, b = Seq(list(range(8))), Seq(list(range(50, 54)))
    assert kv.allocate(a, 8, kv.computed_prefix(a)) and kv.allocate(b, 4, kv.computed_prefix(b))
    kv.preempt(a)  # its replica plans only once its last batch has left: no batch holds it
    assert kv.num_held_pages == 0 and kv.num_free_pages == 6
    # Admission leaves a page for each sequence holding pages (b): 5 pages may be taken, not 6.
    assert not kv.allocate(Seq(list(range(100, 124))), 24, kv.computed_prefix(Seq(list(range(100, 124)))))
    c = Seq(list(range(100, 120)))
    assert kv.allocate(c, 20, kv.computed_prefix(c)) and kv.num_free_pages == 1
    assert kv.allocate(b, 8)  # b grows into the page left for it
    kv.free(b)
    kv.free(c)
    kv.settle(busy=False)
    assert_all_free(kv)
