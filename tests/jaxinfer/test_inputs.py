"""InputBuilder.prepare: a scheduler plan -> the padded arrays of one step, checked entry by
entry (the engine tests check the same arrays only through the tokens they produce)."""

import numpy as np
import pytest

from jaxinfer.config import EngineConfig
from jaxinfer.core.plan import ScheduledSeq, SchedulerPlan
from jaxinfer.core.sequence import PLACEHOLDER, Sequence
from jaxinfer.kv import NULL_PAGE
from jaxinfer.sampling.arrays import fill_defaults
from jaxinfer.sampling.params import MAX_LOGIT_BIAS, SamplingParams
from jaxinfer.worker.inputs import InputBuilder

PAGE = 4


def _builder(pages_per_seq=8):
    engine = EngineConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=32, page_size=PAGE)
    return InputBuilder(engine, (8, 16, 32), pages_per_seq=pages_per_seq, max_model_len=32, vocab_size=64)


def _seq(seq_id, prompt, outputs=(), pending=0):
    seq = Sequence(seq_id, f"r{seq_id}", list(prompt), SamplingParams(temperature=0), seed=0, arrival=seq_id)
    seq.token_ids += list(outputs) + [PLACEHOLDER] * pending
    seq.num_pending = pending
    return seq


def test_a_mixed_plan_fills_every_array():
    """A decode whose token is still in flight, a decode of a known token, and a prefill chunk
    in the middle of its prompt, back to back; the rest is padding."""
    flying = _seq(0, [11, 12, 13, 14, 15], outputs=[16], pending=1)  # 7 tokens, the last in flight
    known = _seq(1, [21, 22, 23], outputs=[24])
    chunk = _seq(2, list(range(31, 41)))  # a 10-token prompt; this step computes tokens 4..8
    previous = SchedulerPlan(
        [ScheduledSeq(known, 2, 1, (7,), sample=False), ScheduledSeq(flying, 5, 1, (1, 2), sample=True)]
    )
    plan = SchedulerPlan(
        [
            ScheduledSeq(flying, 6, 1, (1, 2), sample=True),
            ScheduledSeq(known, 3, 1, (7,), sample=True),
            ScheduledSeq(chunk, 4, 5, (9, 5, 3), sample=False),
        ]
    )
    builder = _builder()
    inputs = builder.prepare(plan, [previous], masks=False)

    assert inputs.token_ids.tolist() == [0, 24, 35, 36, 37, 38, 39, 0]  # bucket 8
    assert inputs.prev_rows.tolist() == [1] + [-1] * 7  # row 1 of the step in flight samples it
    assert inputs.positions.tolist() == [6, 3, 4, 5, 6, 7, 8, 0]
    meta = inputs.meta
    assert meta.cu_q_lens.tolist() == [0, 1, 2, 7, 7, 7, 7, 7, 7]
    assert meta.kv_lens.tolist() == [7, 4, 9, 0, 0, 0, 0, 0]
    assert meta.num_seqs.tolist() == [3]
    pages = np.full((8, 8), NULL_PAGE)
    pages[0, :2], pages[1, :1], pages[2, :3] = [1, 2], [7], [9, 5, 3]
    assert meta.page_indices is None  # read on the device from the page table
    assert inputs.page_slots.tolist() == [1, 2, 3, 0, 0, 0, 0, 0]  # padding: the null row 0
    np.testing.assert_array_equal(builder.tables[0].page_rows(inputs.page_slots), pages[None])
    table = inputs.table  # every entry is new: sent, padded to the smallest width
    assert table.slots.shape == (64,)
    assert list(zip(table.slots[:6].tolist(), table.cols[:6].tolist(), table.pages[:6].tolist())) == [
        (1, 0, 1),
        (1, 1, 2),
        (2, 0, 7),
        (3, 0, 9),
        (3, 1, 5),
        (3, 2, 3),
    ]
    assert not table.slots[6:].any() and not table.cols[6:].any() and not table.pages[6:].any()
    assert inputs.logits_indices.tolist() == [0, 1, 6, 6, 6, 6, 6, 6]


def test_a_placeholder_no_step_in_flight_samples_is_refused():
    flying = _seq(0, [1, 2, 3], outputs=[4], pending=1)
    plan = SchedulerPlan([ScheduledSeq(flying, 4, 1, (1, 2), sample=True)])
    with pytest.raises(RuntimeError, match="r0: a placeholder no step in flight samples"):
        _builder().prepare(plan, None, masks=False)
    other = SchedulerPlan([ScheduledSeq(_seq(5, [9]), 0, 1, (3,), sample=True)])
    with pytest.raises(RuntimeError, match="r0: a placeholder"):
        _builder().prepare(plan, [other], masks=False)


@pytest.mark.parametrize("pages", [(1,), (1, 2, 3)])  # too few for 5 tokens; more than the table
def test_a_sequence_whose_pages_do_not_fit_is_named(pages):
    seq = _seq(3, [1, 2, 3, 4, 5])
    plan = SchedulerPlan(
        [ScheduledSeq(_seq(0, [1]), 0, 1, (4,), sample=True), ScheduledSeq(seq, 0, 5, pages, sample=True)]
    )
    with pytest.raises(RuntimeError, match=f"sequence r3: 5 tokens on {len(pages)} pages"):
        _builder(pages_per_seq=2).prepare(plan, None, masks=False)


def test_defaults_every_row_shares_are_not_sent():
    """No grammar and no logit bias in the plan: the allowed bits and the bias rows are left
    unsent (None; the runner fills them on the device); a biased row sends the bias pair only."""
    plain = SchedulerPlan([ScheduledSeq(_seq(0, [1, 2]), 0, 2, (1,), sample=True)])
    sampling = _builder().prepare(plain, None).sampling
    assert sampling.allowed is None and sampling.bias_ids is None and sampling.bias_values is None
    biased = Sequence(1, "r1", [3], SamplingParams(temperature=0, logit_bias={5: 2.0}), seed=0, arrival=1)
    plan = SchedulerPlan(
        [ScheduledSeq(_seq(0, [1, 2]), 0, 2, (1,), sample=True), ScheduledSeq(biased, 0, 1, (2,), sample=True)]
    )
    sampling = _builder().prepare(plan, None).sampling
    assert sampling.allowed is None
    assert sampling.bias_ids[:2, 0].tolist() == [-1, 5] and sampling.bias_values[1, 0] == 2.0
    filled = fill_defaults(_builder().prepare(plain, None).sampling, vocab_size=64)
    assert filled.allowed.shape == (8, 2) and (filled.allowed == -1).all()
    assert filled.bias_ids.shape == (8, MAX_LOGIT_BIAS) and (filled.bias_ids == -1).all()
    assert not filled.bias_values.any() and filled.bias_values.dtype == np.float16
