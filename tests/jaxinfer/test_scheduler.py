"""Scheduler: exact plans and page ids for chunking, decode-first, priorities, preemption, stops."""

import collections
import random

import pytest

from jaxinfer.core.scheduler import Scheduler
from jaxinfer.core.sequence import SequenceStatus, sample_seed
from jaxinfer.kv import KVCacheManager
from jaxinfer.sampling import SamplingParams

TOKEN = 1000  # what the fake model samples unless a test says otherwise


@pytest.fixture
def make_sched():
    """Builds schedulers; after the test every request must be done and every page free."""
    made = []

    def make(num_pages, page_size, *, budget=64, max_num_seqs=8, max_model_len=256, **kw):
        made.append(
            Scheduler(
                KVCacheManager(num_pages, page_size),
                max_num_batched_tokens=budget,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                **kw,
            )
        )
        return made[-1]

    yield make
    for sched in made:
        assert not sched.has_unfinished() and not sched.requests
        pool = sched.kv_cache.pool
        assert pool.num_free_pages == pool.num_usable_pages
        assert all(pool.ref_count(p) == 0 for p in range(pool.num_pages))


def params(**kw):
    return SamplingParams(**{"max_tokens": 4, **kw})


def step(sched, token_fn=lambda seq: TOKEN):
    """One fake engine step; returns the plan as (request, start, new tokens, pages, sample)."""
    plan = sched.schedule()
    sched.update(plan, [token_fn(e.seq) for e in plan.seqs])
    return [(e.seq.request_id, e.start, e.num_new_tokens, e.pages, e.sample) for e in plan.seqs]


def drain(sched, max_steps=1000):
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return
        step(sched)
    raise AssertionError("scheduler did not finish")


def test_one_request_from_prefill_to_length(make_sched):
    sched = make_sched(9, 4)
    (seq,) = sched.add_request("a", list(range(6)), params(max_tokens=3))
    tokens = iter([100, 101, 102])
    nxt = lambda s: next(tokens)
    assert step(sched, nxt) == [("a", 0, 6, (1, 2), True)]
    assert sched.kv_cache.pool.is_cached(1) and not sched.kv_cache.pool.is_cached(2)
    assert step(sched, nxt) == [("a", 6, 1, (1, 2), True)]
    assert step(sched, nxt) == [("a", 7, 1, (1, 2), True)]
    assert seq.status is SequenceStatus.FINISHED_LENGTH and seq.finish_reason == "length"
    assert seq.output_token_ids == [100, 101, 102] and seq.pages == []
    assert sched.kv_cache.pool.free_page_ids() == [3, 4, 5, 6, 7, 8, 2, 1]  # cached pages, head last
    assert step(sched) == []


def test_long_prompt_is_chunked_across_steps(make_sched):
    sched = make_sched(9, 4, budget=4)
    sched.add_request("a", list(range(10)), params(max_tokens=2))
    assert step(sched) == [("a", 0, 4, (1,), False)]
    assert step(sched) == [("a", 4, 4, (1, 2), False)]
    assert step(sched) == [("a", 8, 2, (1, 2, 3), True)]
    assert step(sched) == [("a", 10, 1, (1, 2, 3), True)]
    assert not sched.has_unfinished()


def test_decodes_go_first_even_before_a_higher_priority_prefill(make_sched):
    sched = make_sched(9, 4, budget=6)
    sched.add_request("a", [1, 2], params(max_tokens=3))
    assert step(sched) == [("a", 0, 2, (1,), True)]
    sched.add_request("b", list(range(12)), params(max_tokens=1), priority=-1)
    assert step(sched) == [("a", 2, 1, (1,), True), ("b", 0, 5, (2, 3), False)]
    assert step(sched) == [("a", 3, 1, (1,), True), ("b", 5, 5, (2, 3, 4), False)]
    assert step(sched) == [("b", 10, 2, (2, 3, 4), True)]


def test_max_num_seqs_caps_the_running_set(make_sched):
    sched = make_sched(9, 4, max_num_seqs=2)
    for rid in "abc":
        sched.add_request(rid, [1, 2], params(max_tokens=2))
    assert step(sched) == [("a", 0, 2, (1,), True), ("b", 0, 2, (2,), True)]
    assert sched.num_running == 2 and sched.num_waiting == 1
    assert step(sched) == [("a", 2, 1, (1,), True), ("b", 2, 1, (2,), True)]
    # a's and b's pages held no full page: uncached, reused first, most recently freed first
    assert step(sched) == [("c", 0, 2, (2,), True)]
    drain(sched)


def test_waiting_queue_is_served_by_priority_then_arrival(make_sched):
    sched = make_sched(9, 4, budget=4)
    sched.add_request("low", [1, 2, 3, 4], params(max_tokens=1), priority=5)
    sched.add_request("mid1", [1, 2, 3, 5], params(max_tokens=1))
    sched.add_request("high", [1, 2, 3, 6], params(max_tokens=1), priority=-1)
    sched.add_request("mid2", [1, 2, 3, 7], params(max_tokens=1))
    order = [step(sched)[0][0] for _ in range(4)]
    assert order == ["high", "mid1", "mid2", "low"]


def test_newest_sequence_is_preempted_and_recomputed_from_the_prefix_cache(make_sched):
    sched = make_sched(5, 2)  # 4 usable pages of 2 tokens
    (a,) = sched.add_request("a", [1, 2, 3], params(max_tokens=4))
    (b,) = sched.add_request("b", [4, 5, 6], params(max_tokens=4))
    assert step(sched) == [("a", 0, 3, (1, 2), True), ("b", 0, 3, (3, 4), True)]
    assert step(sched) == [("a", 3, 1, (1, 2), True), ("b", 3, 1, (3, 4), True)]
    # a needs a third page: b (newest) gives its pages back; a gets b's evicted second page
    plan = sched.schedule()
    assert [(e.seq.request_id, e.start, e.pages) for e in plan.seqs] == [("a", 4, (1, 2, 4))]
    assert plan.preempted == [b] and b.status is SequenceStatus.PREEMPTED
    assert b.num_preemptions == 1 and b.pages == [] and b.num_computed_tokens == 0
    assert sched.kv_cache.pool.free_page_ids() == [3]  # b's first page, still cached
    sched.update(plan, [TOKEN])
    # b cannot come back yet: it needs its cached page 3 plus two fresh ones
    assert step(sched) == [("a", 5, 1, (1, 2, 4), True)]
    assert a.status is SequenceStatus.FINISHED_LENGTH
    # b recomputes prompt + its 2 outputs, the first page from the cache
    assert b.output_token_ids == [TOKEN, TOKEN]
    assert step(sched) == [("b", 2, 3, (3, 4, 2), True)]
    assert step(sched) == [("b", 5, 1, (3, 4, 2), True)]
    assert b.status is SequenceStatus.FINISHED_LENGTH and b.output_token_ids == [TOKEN] * 4
    assert (sched.kv_cache.pool.prefix_cache_queries, sched.kv_cache.pool.prefix_cache_hits) == (11, 2)


def test_a_planned_lower_priority_decode_is_taken_out_of_the_plan(make_sched):
    sched = make_sched(5, 2, budget=4)
    (low,) = sched.add_request("low", [1, 2], params(max_tokens=5), priority=5)
    assert step(sched) == [("low", 0, 2, (1,), True)]
    (high,) = sched.add_request("high", [3, 4, 5, 6, 7, 8, 9], params(max_tokens=1))
    assert step(sched) == [("low", 2, 1, (1, 2), True), ("high", 0, 3, (3, 4), False)]
    plan = sched.schedule()  # low's decode is planned first, then preempted for high's chunk
    assert [(e.seq.request_id, e.start, e.num_new_tokens, e.pages) for e in plan.seqs] == [("high", 3, 3, (3, 4, 2))]
    assert plan.preempted == [low] and plan.num_batched_tokens == 3
    sched.update(plan, [TOKEN])
    assert step(sched) == [("high", 6, 1, (3, 4, 2, 1), True)]
    assert step(sched) == [("low", 0, 4, (1, 2), True)]
    drain(sched)
    assert low.output_token_ids == [TOKEN] * 5


def test_a_sequence_that_is_newest_preempts_itself(make_sched):
    sched = make_sched(4, 2, budget=3)
    sched.add_request("a", [1, 2], params(max_tokens=4))
    (b,) = sched.add_request("b", [3, 4, 5, 6, 7], params(max_tokens=1))
    assert step(sched) == [("a", 0, 2, (1,), True), ("b", 0, 1, (2,), False)]
    plan = sched.schedule()
    assert [(e.seq.request_id, e.pages) for e in plan.seqs] == [("a", (1, 3))]
    assert plan.preempted == [b]
    sched.update(plan, [TOKEN])
    assert step(sched) == [("a", 3, 1, (1, 3), True), ("b", 0, 2, (2,), False)]
    drain(sched)


def test_a_request_that_fills_the_pool_runs_and_ids_are_unique(make_sched):
    """What can never fit is refused before the scheduler (core/requests.py, test_requests.py);
    one that just fits runs to its end."""
    sched = make_sched(4, 4, max_model_len=16)  # 3 usable pages = 12 tokens of KV
    # 10 + 3 tokens keep KV for 12: exactly the pool, and it runs to the end
    (seq,) = sched.add_request("a", list(range(10)), params(max_tokens=3))
    with pytest.raises(ValueError, match="request id 'a' is already in use"):
        sched.add_request("a", [1], params())
    drain(sched)
    assert seq.num_output_tokens == 3 and not sched.waiting


def test_a_scoring_request_computes_its_prompt_and_outputs_nothing(make_sched):
    """max_tokens=0: the prompt is computed (its pages cached) and the sampled token dropped."""
    sched = make_sched(5, 4, max_model_len=16)
    (seq,) = sched.add_request("s", list(range(16)), params(max_tokens=0))  # fills the context
    plan = sched.schedule()
    assert [(e.start, e.num_new_tokens, e.sample) for e in plan.seqs] == [(0, 16, True)]
    assert sched.update(plan, [TOKEN]) == [seq]
    assert seq.status is SequenceStatus.FINISHED_LENGTH and seq.num_output_tokens == 0
    assert seq.token_ids == list(range(16)) and sched.kv_cache.pool.num_cached_pages == 4


def test_stop_conditions(make_sched):
    stop_on_9 = lambda seq: "<nine>" if seq.last_token_id == 9 else None
    sched = make_sched(17, 4, eos_token_ids=[2], stop_checker=stop_on_9)
    (eos,) = sched.add_request("eos", [1], params(max_tokens=10))
    (ign,) = sched.add_request("ignore", [1], params(max_tokens=3, ignore_eos=True))
    (sid,) = sched.add_request("stop_id", [1], params(max_tokens=10, stop_token_ids=[7]))
    (cb,) = sched.add_request("callback", [1], params(max_tokens=10))
    script = {"eos": [5, 2], "ignore": [2, 2, 2], "stop_id": [5, 7], "callback": [9]}
    it = {k: iter(v) for k, v in script.items()}
    for _ in range(3):
        step(sched, lambda s: next(it[s.request_id]))
    assert (eos.status, eos.stop_reason, eos.output_token_ids) == (SequenceStatus.FINISHED_STOPPED, None, [5, 2])
    assert (ign.status, ign.output_token_ids) == (SequenceStatus.FINISHED_LENGTH, [2, 2, 2])
    assert (sid.finish_reason, sid.stop_reason, sid.output_token_ids) == ("stop", 7, [5, 7])
    assert (cb.finish_reason, cb.stop_reason) == ("stop", "<nine>")
    assert not sched.has_unfinished()


def test_max_model_len_ends_a_sequence(make_sched):
    sched = make_sched(9, 4, max_model_len=5)
    (seq,) = sched.add_request("a", [1, 2, 3], params(max_tokens=2))
    drain(sched)
    assert seq.num_tokens == 5 and seq.finish_reason == "length"


def test_abort_waiting_running_and_between_schedule_and_update(make_sched):
    sched = make_sched(9, 4, max_num_seqs=2)
    for rid in "abc":
        sched.add_request(rid, [1, 2, 3], params(max_tokens=5))
    assert sched.abort("c")[0].status is SequenceStatus.FINISHED_ABORTED
    assert sched.abort("c") == [] and sched.abort("unknown") == []
    plan = sched.schedule()
    (aborted,) = sched.abort("a")
    assert aborted.finish_reason == "abort" and aborted.pages == []
    updated = sched.update(plan, [TOKEN, TOKEN])
    assert [s.request_id for s in updated] == ["b"]
    assert aborted.num_output_tokens == 0
    assert step(sched) == [("b", 3, 1, (2,), True)]
    sched.abort("b")


def test_update_needs_a_token_per_planned_sequence(make_sched):
    sched = make_sched(9, 4)
    sched.add_request("a", [1, 2], params(max_tokens=1))
    plan = sched.schedule()
    with pytest.raises(ValueError, match="0 sampled tokens for a plan of 1 sequences"):
        sched.update(plan, [])
    sched.update(plan, [TOKEN, 0, 0])  # padding rows beyond the plan are ignored


def test_parallel_samples_share_the_prompt_pages(make_sched):
    sched = make_sched(17, 4)
    seqs = sched.add_request("n3", list(range(10)), params(n=3, max_tokens=2, seed=123))
    assert [s.sample_index for s in seqs] == [0, 1, 2]
    assert seqs[0].seed == 123 and len({s.seed for s in seqs}) == 3
    assert seqs[2].seed == sample_seed(123, 2)
    # the siblings wait until the parent has computed the prompt
    assert step(sched) == [("n3", 0, 10, (1, 2, 3), True)]
    # then take its full prompt pages and recompute only the partial last page
    assert step(sched) == [("n3", 10, 1, (1, 2, 3), True), ("n3", 8, 2, (1, 2, 4), True), ("n3", 8, 2, (1, 2, 5), True)]
    assert [sched.kv_cache.pool.ref_count(p) for p in (1, 2, 3, 4, 5)] == [2, 2, 0, 1, 1]
    drain(sched)
    assert all(s.output_token_ids == [TOKEN, TOKEN] for s in seqs)
    assert sched.abort("n3") == []


def test_second_request_computes_only_what_the_prefix_cache_lacks(make_sched):
    sched = make_sched(17, 4)
    shared = list(range(100, 112))
    sched.add_request("first", shared + [1, 2], params(max_tokens=1))
    assert step(sched) == [("first", 0, 14, (1, 2, 3, 4), True)]
    (second,) = sched.add_request("second", shared + [3, 4, 5], params(max_tokens=1))
    # first's partial last page 4 was uncached, so it is the first page reused
    assert step(sched) == [("second", 12, 3, (1, 2, 3, 4), True)]
    pool = sched.kv_cache.pool
    assert (pool.prefix_cache_queries, pool.prefix_cache_hits) == (29, 12)


def test_unseeded_requests_get_reproducible_distinct_seeds():
    def seeds(sched_seed):
        sched = Scheduler(
            KVCacheManager(9, 4), max_num_batched_tokens=8, max_num_seqs=4, max_model_len=32, seed=sched_seed
        )
        return [s.seed for rid in "ab" for s in sched.add_request(rid, [1], params(n=2))]

    assert seeds(0) == seeds(0) != seeds(1)
    assert len(set(seeds(0))) == 4


def test_random_workload_keeps_the_invariants(make_sched):
    rng = random.Random(0)
    sched = make_sched(13, 4, budget=16, max_num_seqs=5, max_model_len=40)
    pool, next_id = sched.kv_cache.pool, 0
    for _ in range(400):
        if rng.random() < 0.3 and len(sched.requests) < 8:
            prompt = [rng.randrange(4) for _ in range(rng.randrange(1, 20))]  # shared prefixes
            sched.add_request(
                f"r{next_id}",
                prompt,
                params(n=rng.choice([1, 1, 2]), max_tokens=rng.randrange(1, 12)),
                priority=rng.randrange(2),
            )
            next_id += 1
        if rng.random() < 0.05 and sched.requests:
            sched.abort(rng.choice(list(sched.requests)))
        plan = sched.schedule()
        assert plan.num_batched_tokens <= 16 and sched.num_running <= 5
        refs = collections.Counter(p for s in sched.running for p in s.pages)
        assert all(pool.ref_count(p) == refs[p] for p in range(pool.num_pages))
        for e in plan.seqs:
            assert len(e.pages) * 4 >= e.kv_len and e.seq.status is SequenceStatus.RUNNING
        sched.update(plan, [rng.randrange(4) for _ in plan.seqs])
    drain(sched)
    assert next_id > 50
