"""A draft model: a second, smaller model (same vocabulary) that proposes k tokens greedily.

It has its own Worker (parameters, KV pages, compiled steps) and KV cache manager, and runs in
the engine loop before the target's step: per speculating sequence a draft-side Sequence mirrors
the target's tokens. One propose() call is two launches of the draft's worker:

    catch-up  the tokens the draft has not computed (the whole prompt at first, then the one or
              two tokens verified since), as one ragged step that samples d0 (argmax)
    window    k - 1 decode steps in one jitted call (a decode window), fed d0, d1, ... on the
              device, writing their K/V at positions len .. len + k - 2

then the drafts are fetched once. The draft's K/V of d0 .. d(k-2) stays valid as far as the
target accepted them: before the next catch-up, the draft's computed length is cut back to the
longest prefix its tokens share with the target's (rejected drafts' slots are overwritten).
A sequence whose catch-up does not fit the token budget catches up in chunks over several steps,
proposing nothing meanwhile; one whose pages do not fit proposes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

import numpy as np

from jaxinfer.config import EngineConfig
from jaxinfer.core.plan import ScheduledSeq, SchedulerPlan
from jaxinfer.core.replica import kv_groups
from jaxinfer.core.sequence import PLACEHOLDER, Sequence
from jaxinfer.kv import KVCacheManager
from jaxinfer.loader import LoadedModel
from jaxinfer.sampling.params import SamplingParams
from jaxinfer.sampling.sampler import SamplerOutput
from jaxinfer.spec_decode.proposer import Proposer
from jaxinfer.worker.worker import StepHandle, Worker

_GREEDY = SamplingParams(temperature=0.0)


class _DraftSeq(Sequence):
    confirmed: int = 0  # leading tokens known equal to the target's (their K/V is valid)


class DraftModelProposer(Proposer):
    def __init__(
        self, model: LoadedModel, target: LoadedModel, engine: EngineConfig, max_model_len: int, num_pages: int, k: int
    ):
        if model.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"speculative_config.model: the draft's vocabulary has {model.config.vocab_size} "
                f"tokens, the target's {target.config.vocab_size}; they must share one"
            )
        if model.config.max_position_embeddings < max_model_len:
            raise ValueError(
                f"speculative_config.model: the draft's context of "
                f"{model.config.max_position_embeddings} tokens is shorter than "
                f"max_model_len={max_model_len}"
            )
        self.k = k
        config = engine.replace(
            speculative_config=None,
            num_pages=num_pages,
            kv_cache_bytes=None,
            kv_cache_dtype="auto",
            penalties=False,
            enable_prefix_caching=False,
            structured_output_overlap=False,
            dispatch_thread=False,
            num_decode_steps=max(k - 1, 1),
            mesh=None,
        )
        self.worker = Worker(model, config, max_model_len)
        groups = kv_groups(self.worker.kv_layout, margin=k)  # a rejected draft's tokens are computed again
        self.kv_cache = KVCacheManager(
            self.worker.num_pages, self.worker.page_size, enable_prefix_caching=False, groups=groups
        )
        self.budget = self.worker.max_batched_tokens
        self._seqs: dict[int, _DraftSeq] = {}
        self.num_proposals = 0
        self.seconds = 0.0

    def warm_up(self) -> float:
        return self.worker.warm_up()

    def release(self, live_seq_ids: set[int]) -> None:
        for seq_id in [s for s in self._seqs if s not in live_seq_ids]:
            self.kv_cache.free(self._seqs.pop(seq_id))

    def stats(self) -> dict:
        return {"draft_kv_pages_free": self.kv_cache.num_free_pages, "draft_seconds": self.seconds}

    def propose(self, seqs: Seq[Sequence], max_drafts: Seq[int]) -> list[list[int]]:
        start = time.perf_counter()
        entries, budget = [], self.budget
        for seq in seqs:
            entry = self._catch_up(seq, budget)
            if entry is not None:
                entries.append(entry)
                budget -= entry.num_new_tokens
        drafts = self._run(entries) if entries else {}
        self.seconds += time.perf_counter() - start
        return [drafts.get(seq.seq_id, [])[:cap] for seq, cap in zip(seqs, max_drafts)]

    def _sync(self, seq: Sequence) -> _DraftSeq:
        """The draft-side sequence of `seq`, its tokens now the target's and its computed length
        cut to the prefix they share (drafts the target rejected are recomputed)."""
        draft = self._seqs.get(seq.seq_id)
        if draft is None:
            draft = self._seqs[seq.seq_id] = _DraftSeq(seq.seq_id, seq.request_id, [], _GREEDY, seed=0, arrival=0)
        target, n = seq.token_ids, draft.confirmed
        limit = min(draft.num_computed_tokens, len(target))
        while n < limit and draft.token_ids[n] == target[n]:
            n += 1
        draft.num_computed_tokens = draft.confirmed = min(n, len(target) - 1)
        draft.token_ids[n:] = target[n:]
        return draft

    def _catch_up(self, seq: Sequence, budget: int) -> ScheduledSeq | None:
        """The draft's share of the catch-up step (None: no budget or pages left)."""
        draft = self._sync(seq)
        todo = draft.num_tokens - draft.num_computed_tokens
        n = min(todo, budget)
        if n <= 0:
            return None
        end = draft.num_computed_tokens + n + (self.k - 1 if n == todo else 0)
        if not self.kv_cache.allocate(draft, end):
            return None
        return ScheduledSeq.of(draft, draft.num_computed_tokens, n, sample=n == todo)

    def _run(self, entries: list[ScheduledSeq]) -> dict[int, list[int]]:
        """The catch-up step, then the window; the drafts of each sequence that sampled."""
        first = SchedulerPlan(entries)
        handles = [self.worker.execute([first])]
        for e in entries:
            e.seq.num_computed_tokens = e.kv_len
            if e.sample:
                e.seq.token_ids.append(PLACEHOLDER)
        rows = [row for row, e in enumerate(entries) if e.sample]
        if rows and self.k > 1:
            window = SchedulerPlan(
                [ScheduledSeq.of(entries[r].seq, entries[r].kv_len, 1, sample=True) for r in rows],
                num_steps=self.worker.num_decode_steps,
            )
            handles.append(self.worker.execute([window], handles[0]))
        outs = [_sampled(h).tokens for h in handles]
        later = np.asarray(outs[1]).reshape(-1, outs[1].shape[-1]) if len(outs) > 1 else np.zeros((0, len(rows)))
        drafts = {}
        for i, row in enumerate(rows):
            draft = entries[row].seq
            tokens = [int(outs[0][row])] + [int(t) for t in later[:, i]]
            del draft.token_ids[-1]  # the placeholder of d0
            draft.token_ids += tokens[: self.k - 1]  # the drafts whose K/V the window wrote
            draft.num_computed_tokens = draft.num_tokens
            drafts[draft.seq_id] = tokens
        self.num_proposals += len(rows)
        return drafts


def _sampled(handle: StepHandle) -> SamplerOutput:
    """A draft step's outputs (the draft model verifies nothing: a plain step's)."""
    out = handle.result()
    if not isinstance(out, SamplerOutput):
        raise RuntimeError(f"a draft step returned {type(out).__name__}, not a plain step's outputs")
    return out
