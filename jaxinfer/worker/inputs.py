"""Step inputs: a scheduler plan -> StepInputs (step_inputs.py), numpy arrays padded to a compiled bucket.

    SchedulerPlan (host, jaxinfer.core)
      --InputBuilder.prepare--> StepInputs: token ids and positions [T], attention metadata
        (kv_lens [S], cu_q_lens [S+1], num_seqs [1]; page_indices [S, pages_per_seq] is read on
        the device from the page table by `page_slots` [S], after the `table` entries that
        changed are set: page_table.py), the row of each sequence's last token [S], sampling
        arrays [S] (with the allowed-token bits of the sequences that have a grammar, from their
        matchers); T is the smallest token bucket that holds the plan and S =
        EngineConfig.seq_bucket(T)

Speculative decoding: when the plan has drafts, `spec` holds them ([S, K], K the static
num_speculative_tokens) and `logits_indices` names K + 1 rows per sequence [S*(K+1)]: its last
known token and each draft (a sequence with fewer repeats its last row); None otherwise (another
compiled variant).

Prompt logprobs: when a chunk of the plan belongs to a prompt whose request asked for them
(SamplingParams.prompt_logprobs, sample 0 only: the samples share the prompt), `prompt` holds
the prompt token each of its rows predicts ([T], -1 elsewhere); None otherwise (another variant).

A sequence whose newest token was sampled by the step still in flight (async scheduling) has a
PLACEHOLDER there: its input id is taken on the device from that step's sampled tokens, at the
row `prev_rows` names (-1: the id in token_ids is the input).

What did not change is not sent: the page table's rows stay on the device (only changed entries
travel), and the allowed-token bits and logit-bias rows are None when no row of the plan has a
grammar or a bias (sampling.arrays.unsent_defaults; the compiled step fills them on the device).

Padding is harmless by construction: padding tokens belong to no sequence (cu_q_lens stops at
the real count), padding sequences have kv_len 0 and the null row of the page table (all the null page 0,
which no sequence owns); nothing ever indexes page -1. With data replicas every replica's inputs are built
the same way and stacked along a leading [data] axis (an idle replica is all padding).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from jaxinfer.config import EngineConfig
from jaxinfer.core.plan import SchedulerPlan
from jaxinfer.core.sequence import PLACEHOLDER
from jaxinfer.models.layers import AttentionMetadata
from jaxinfer.sampling.arrays import (
    fill_defaults,
    make_sampling_arrays,
    sampling_arrays_for_sequences,
    unsent_defaults,
)
from jaxinfer.sampling.params import SamplingParams
from jaxinfer.sampling.prompt_logprobs import PromptInputs
from jaxinfer.sampling.rejection import SpecInputs
from jaxinfer.structured import ReasoningGate, RowMatcher, fill_bitmask
from jaxinfer.worker.page_table import NULL_ROW, PageTableMirror, no_updates, padded_updates, update_widths
from jaxinfer.worker.step_inputs import StepInputs


class InputBuilder:
    """Builds the padded inputs of the compiled step's variants."""

    def __init__(
        self,
        engine: EngineConfig,
        buckets: tuple[int, ...],
        *,
        pages_per_seq: int,
        max_model_len: int,
        vocab_size: int,
        num_replicas: int = 1,
        num_speculative_tokens: int = 0,
        num_groups: int = 1,
        in_flight: int = 1,
    ):
        self.engine = engine
        self.num_speculative_tokens = num_speculative_tokens  # K: the width of verify steps' drafts
        self.vocab_size = vocab_size  # the width of the allowed-token bits (structured output)
        self.buckets = buckets
        self.ready: tuple[int, ...] | None = None  # the buckets compiled so far (None: all; background.py)
        self.pages_per_seq = pages_per_seq
        self.max_model_len = max_model_len  # the penalty-history width
        self.num_replicas = num_replicas
        # The page table's host mirror per replica: a slot per sequence of the largest plan (of
        # each batch in flight: pipeline stages, page_table.py).
        num_rows = in_flight * engine.seq_bucket(buckets[-1]) + 1
        self.update_widths = update_widths(num_rows, pages_per_seq, num_groups=num_groups)
        self.tables = [PageTableMirror(num_rows, pages_per_seq, num_groups, in_flight) for _ in range(num_replicas)]

    def bucket_for(self, num_tokens: int) -> int:
        """The smallest (ready) token bucket holding num_tokens."""
        for b in self.ready or self.buckets:
            if b >= num_tokens:
                return b
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {self.buckets[-1]}")

    def prepare(
        self, plan: SchedulerPlan | list[SchedulerPlan], previous: list[SchedulerPlan] | None = None, masks: bool = True
    ) -> StepInputs[np.ndarray]:
        """Host-side arrays for one step, padded to the plan's bucket. With data replicas, one
        plan per replica (an empty plan is all padding) stacked along a leading axis.
        `previous`: the plans of the step in flight, whose sampled tokens fill placeholders."""
        plans = [plan] if isinstance(plan, SchedulerPlan) else list(plan)
        previous_plans: Sequence[SchedulerPlan | None] = previous or [None] * len(plans)
        if len(plans) != self.num_replicas:
            raise ValueError(f"{len(plans)} plans for {self.num_replicas} data replicas")
        t_bucket = self.bucket_for(max(p.num_batched_tokens for p in plans))
        penalties = any(s.seq.sampling_params.uses_penalties for p in plans for s in p.seqs)
        rows = [self._prepare_one(p, t_bucket, penalties, prev) for p, prev in zip(plans, previous_plans)]
        if self.engine.lora.enable_lora:
            rows = [dataclasses.replace(r, lora_slots=lora_slots(p, t_bucket)) for p, r in zip(plans, rows)]
        changes = []
        for i, (plan_i, table) in enumerate(zip(plans, self.tables)):  # every plan checked first
            slots, changed = table.sync(plan_i.seqs, len(rows[i].page_slots))
            rows[i] = dataclasses.replace(rows[i], page_slots=slots)
            changes.append(changed)
        if any(r.prompt is not None for r in rows):  # one tree for every replica
            rows = [dataclasses.replace(r, prompt=r.prompt or _no_prompt_rows(t_bucket)) for r in rows]
        if len({jax.tree.structure(r.sampling) for r in rows}) > 1:
            rows = [dataclasses.replace(r, sampling=fill_defaults(r.sampled(), self.vocab_size)) for r in rows]
        if masks:
            for plan_i, row in zip(plans, rows):
                self.fill_masks(plan_i, row)
        inputs = rows[0] if self.num_replicas == 1 else jax.tree.map(lambda *r: np.stack(r), *rows)
        return dataclasses.replace(inputs, table=padded_updates(changes, self.update_widths))

    @staticmethod
    def fill_masks(plan: SchedulerPlan, inputs: StepInputs[np.ndarray], device_busy: bool = False) -> None:
        """Fills the allowed-token bits of the plan's grammar rows, whose matchers must have
        consumed every earlier token of their sequence (`device_busy`: a forward runs beside)."""
        matchers = ((e.seq.grammar, row) for row, e in enumerate(plan.seqs))
        grammars = [(m, row) for m, row in matchers if isinstance(m, RowMatcher | ReasoningGate)]  # or None
        if grammars:
            if (allowed := inputs.sampled().allowed) is None:  # never: a grammar row's bits are sent
                raise ValueError("the inputs of a plan with grammar rows carry no allowed-token bits")
            fill_bitmask(grammars, allowed, device_busy)

    def _prepare_one(
        self, plan: SchedulerPlan, t_bucket: int, penalties: bool, previous: SchedulerPlan | None
    ) -> StepInputs[np.ndarray]:
        if not plan.seqs:  # an idle data replica: all padding
            return self._dummy_one(t_bucket, penalties)
        s_bucket = self.engine.seq_bucket(t_bucket)
        n = len(plan.seqs)
        tokens = np.zeros(t_bucket, np.int32)
        positions = np.zeros(t_bucket, np.int32)
        cu = np.zeros(s_bucket + 1, np.int32)
        kv_lens = np.zeros(s_bucket, np.int32)
        prev_rows = np.full(t_bucket, -1, np.int32)
        sampled_row = {} if previous is None else {e.seq.seq_id: row for row, e in enumerate(previous.seqs) if e.sample}
        offset = 0
        for i, s in enumerate(plan.seqs):
            for table in s.tables:
                if len(table) > self.pages_per_seq or s.kv_len > len(table) * self.engine.cache.chosen_page_size:
                    raise RuntimeError(f"sequence {s.seq.request_id}: {s.kv_len} tokens on {len(table)} pages")
            ids = s.token_ids  # a slice of the sequence's tokens, built once
            tokens[offset : offset + s.num_new_tokens] = ids
            if ids[-1] == PLACEHOLDER:  # a decode of a token still in flight
                if s.seq.seq_id not in sampled_row:
                    raise RuntimeError(f"sequence {s.seq.request_id}: a placeholder no step in flight samples")
                tokens[offset + s.num_new_tokens - 1] = 0
                prev_rows[offset + s.num_new_tokens - 1] = sampled_row[s.seq.seq_id]
            positions[offset : offset + s.num_new_tokens] = np.arange(s.start, s.kv_len)
            kv_lens[i] = s.kv_len
            offset += s.num_new_tokens
            cu[i + 1] = offset
        cu[n + 1 :] = offset
        seqs = [s.seq for s in plan.seqs]
        grammar = any(seq.grammar is not None for seq in seqs)  # else no allowed bits are sent
        sampling = unsent_defaults(
            sampling_arrays_for_sequences(
                seqs,
                s_bucket,
                history_len=self.max_model_len if penalties else None,
                vocab_size=self.vocab_size if grammar else None,
            ),
            grammar,
        )
        meta = AttentionMetadata(kv_lens=kv_lens, page_indices=None, cu_q_lens=cu, num_seqs=np.array([n], np.int32))
        slots = np.full(s_bucket, NULL_ROW, np.int32)  # set by the page-table sync
        if plan.verifies:
            rows, spec = self._spec_rows(plan, cu)
            return StepInputs(tokens, positions, meta, rows, sampling, prev_rows, slots, spec)
        return StepInputs(
            tokens,
            positions,
            meta,
            np.maximum(cu[1:] - 1, 0),
            sampling,
            prev_rows,
            slots,
            prompt=prompt_inputs(plan, t_bucket),
        )

    def _spec_rows(self, plan: SchedulerPlan, cu: np.ndarray) -> tuple[np.ndarray, SpecInputs[np.ndarray]]:
        """A verify step's logits rows [S*(K+1)] and drafts [S, K] (module docstring)."""
        k, n, s_bucket = self.num_speculative_tokens, len(plan.seqs), len(cu) - 1
        spec = _no_drafts(s_bucket, k)
        counts = np.array([len(e.drafts) for e in plan.seqs], np.int32)
        if counts.max() > k:
            raise RuntimeError(f"{counts.max()} drafts for a verify step of width {k}")
        for i, e in enumerate(plan.seqs):
            spec.draft_ids[i, : counts[i]] = e.drafts
        spec.num_drafts[:n] = counts
        rows = np.zeros((s_bucket, k + 1), np.int32)
        rows[:n] = (cu[1 : n + 1] - 1 - counts)[:, None] + np.minimum(np.arange(k + 1), counts[:, None])
        return rows.reshape(-1), spec

    def padding_inputs(
        self, t_bucket: int, with_history: bool, spec: bool = False, prompt: bool = False, table_width: int = 0
    ) -> StepInputs[np.ndarray]:
        """All-padding inputs of one bucket (one row per replica): writes nothing, reads only
        the null page. `spec`: of the verify variant; `prompt`: of the prompt-logprobs one;
        `table_width`: with that many page-table entries to set (all padding)."""
        one = self._dummy_one(t_bucket, with_history)
        if table_width:
            one = dataclasses.replace(one, table=no_updates(table_width))
        if prompt:
            one = dataclasses.replace(one, prompt=_no_prompt_rows(t_bucket))
        if spec:
            s_bucket = self.engine.seq_bucket(t_bucket)
            one = dataclasses.replace(
                one,
                logits_indices=np.zeros(s_bucket * (self.num_speculative_tokens + 1), np.int32),
                spec=_no_drafts(s_bucket, self.num_speculative_tokens),
            )
        if self.num_replicas == 1:
            return one
        return jax.tree.map(lambda x: np.stack([x] * self.num_replicas), one)

    def _dummy_one(self, t_bucket: int, with_history: bool) -> StepInputs[np.ndarray]:
        s_bucket = self.engine.seq_bucket(t_bucket)
        params = [SamplingParams(repetition_penalty=1.1 if with_history else 1.0)]
        sampling = make_sampling_arrays(
            params,
            [0],
            batch_size=s_bucket,
            seeds=[0],
            prompt_token_ids=[[0]],
            output_token_ids=[[]],
            history_len=self.max_model_len if with_history else None,
            vocab_size=self.vocab_size,
        )
        meta = AttentionMetadata(
            kv_lens=np.zeros(s_bucket, np.int32),
            page_indices=None,
            cu_q_lens=np.zeros(s_bucket + 1, np.int32),
            num_seqs=np.zeros(1, np.int32),
        )
        return StepInputs(
            np.zeros(t_bucket, np.int32),
            np.zeros(t_bucket, np.int32),
            meta,
            np.zeros(s_bucket, np.int32),
            sampling,
            np.full(t_bucket, -1, np.int32),
            np.full(s_bucket, NULL_ROW, np.int32),
            lora_slots=np.zeros(t_bucket, np.int32) if self.engine.lora.enable_lora else None,
        )


def lora_slots(plan: SchedulerPlan, t_bucket: int) -> np.ndarray:
    """i32[T]: each token's LoRA slot (its sequence's; 0: no adapter, and every padding token)."""
    slots = np.zeros(t_bucket, np.int32)
    offset = 0
    for s in plan.seqs:
        slots[offset : offset + s.num_new_tokens] = s.seq.lora_slot
        offset += s.num_new_tokens
    return slots


def _no_drafts(s_bucket: int, k: int) -> SpecInputs[np.ndarray]:
    return SpecInputs(np.full((s_bucket, k), -1, np.int32), np.zeros(s_bucket, np.int32))


def _no_prompt_rows(t_bucket: int) -> PromptInputs[np.ndarray]:
    return PromptInputs(np.full(t_bucket, -1, np.int32), np.zeros(1, np.int32))


def prompt_inputs(plan: SchedulerPlan, t_bucket: int) -> PromptInputs[np.ndarray] | None:
    """The prompt rows of the plan to score (module docstring), or None when there are none."""
    targets, num_top, offset = None, 0, 0
    for e in plan.seqs:
        seq = e.seq
        want = seq.sampling_params.prompt_logprobs
        # Row p predicts prompt token p + 1: the rows of this chunk before the prompt's last, less
        # those scored before (a prompt computed again after a preemption is not scored again).
        start, end = max(e.start, seq.num_scored_prompt), min(e.kv_len, seq.num_prompt_tokens - 1)
        if want is not None and seq.sample_index == 0 and end > start:
            if targets is None:
                targets = np.full(t_bucket, -1, np.int32)
            targets[offset + start - e.start : offset + end - e.start] = seq.token_ids[start + 1 : end + 1]
            num_top = max(num_top, want)
        offset += e.num_new_tokens
    return None if targets is None else PromptInputs(targets, np.array([num_top], np.int32))
