"""Pipeline stages with a batch in flight on each, host side: which virtual replica enters a
batch each tick (core/turns.py), page-table slots never taken from a batch in flight, and a
batch's inputs padded to a tick's larger bucket (worker/pipelined.py). The engine on 8 forced CPU
devices: tests/sharding/test_stages.py."""

import numpy as np

from jaxinfer.config import EngineConfig
from jaxinfer.core.plan import ScheduledSeq, SchedulerPlan
from jaxinfer.core.sequence import Sequence
from jaxinfer.core.turns import PipelineTurns
from jaxinfer.kv.held import HeldFreesManager
from jaxinfer.sampling.params import SamplingParams
from jaxinfer.worker.inputs import InputBuilder
from jaxinfer.worker.page_table import NULL_ROW, PageTableMirror
from jaxinfer.worker.pipelined import _pad


class FakeScheduler:
    def __init__(self, work: int):
        self.work, self.asked = work, 0

    def schedule(self, num_steps: int) -> SchedulerPlan:
        assert num_steps == 1
        self.asked += 1
        if not self.work:
            return SchedulerPlan([])
        self.work -= 1
        return SchedulerPlan([object()])  # type: ignore[list-item]  # only its truth is read


def test_a_replica_enters_again_only_once_its_batch_has_left():
    turns = PipelineTurns(3, HeldFreesManager(8, 4, delay=2))
    schedulers = [FakeScheduler(10), FakeScheduler(10), FakeScheduler(10)]
    entered = []
    for _ in range(9):
        plans, replicas = turns.schedule(schedulers, 8)
        turns.launched(replicas)
        entered.append(replicas)
    assert entered == [[0], [1], [2]] * 3  # round robin: each stage always has a batch


def test_an_idle_replica_gives_its_turn_and_ticks_drain_the_pipeline():
    turns = PipelineTurns(2, HeldFreesManager(8, 4, delay=1))
    schedulers = [FakeScheduler(3), FakeScheduler(0)]
    entered = []
    for _ in range(6):
        plans, replicas = turns.schedule(schedulers, 1)
        turns.launched(replicas)  # a tick with no plan still moves the pipeline on
        entered.append(replicas)
    # replica 0 may enter every other tick only: its batch needs two ticks to leave
    assert entered == [[0], [], [0], [], [0], []]
    assert schedulers[1].asked == 5  # asked whenever its turn came (every tick but the first), planned nothing


def _seq(seq_id):
    return Sequence(seq_id, f"r{seq_id}", [1], SamplingParams(), seed=0, arrival=seq_id)


def test_slots_named_by_a_batch_in_flight_are_not_taken_over():
    table = PageTableMirror(5, 4, in_flight=2)  # 2 x 2 sequences + the null row
    plan = lambda *ids: [ScheduledSeq(_seq(i), 0, 1, (i,), sample=True) for i in ids]  # noqa: E731
    a, _ = table.sync(plan(1, 2), 2)
    b, _ = table.sync(plan(3, 4), 2)  # replica 1's batch; replica 0's still in flight
    assert set(a) & set(b) == set() and NULL_ROW not in set(a) | set(b)
    c, _ = table.sync(plan(5, 6), 2)  # replica 0 again: its old batch has left, replica 1's has not
    assert sorted(c) == sorted(a)


def test_a_batch_padded_to_a_larger_bucket_keeps_its_tokens_and_adds_only_padding():
    engine = EngineConfig(max_num_batched_tokens=32, token_buckets=(8, 32), max_num_seqs=8).with_page_size(64)
    builder = InputBuilder(engine, (8, 32), pages_per_seq=4, max_model_len=64, vocab_size=50)
    seqs = [Sequence(i, f"r{i}", [3, 4, 5], SamplingParams(temperature=0.5), seed=i, arrival=i) for i in (1, 2)]
    for seq in seqs:
        seq.pages = [1 + seq.seq_id]
    inputs = builder.prepare(SchedulerPlan([ScheduledSeq.of(seq, 0, 3, sample=True) for seq in seqs]))
    padded = _pad(inputs, 32, engine.seq_bucket)
    t0, s0, s = 8, len(inputs.page_slots), engine.seq_bucket(32)
    assert padded.token_ids.shape == (32,) and (padded.token_ids[:t0] == inputs.token_ids).all()
    assert (padded.token_ids[t0:] == 0).all() and (padded.positions[t0:] == 0).all()
    assert (padded.prev_rows[t0:] == -1).all()
    assert padded.meta.cu_q_lens.shape == (s + 1,) and (padded.meta.cu_q_lens[s0:] == 6).all()
    assert (padded.meta.kv_lens[s0:] == 0).all() and (padded.page_slots[s0:] == NULL_ROW).all()
    assert padded.meta.num_seqs.tolist() == [2]
    temperature = padded.sampled().temperature
    assert temperature.shape == (s,) and np.allclose(temperature[:2], 0.5)
    assert _pad(inputs, 8, engine.seq_bucket) is inputs
