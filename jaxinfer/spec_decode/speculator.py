"""Speculator: speculative decoding inside the engine's step loop.

    Engine.step():
      the step in flight lands first      while a running sequence may speculate, or when the
                                          step in flight verified drafts (must_land_first)
      speculator.propose(scheduler)       drafts for each running sequence that decodes
                                          (seq.draft_token_ids), from the proposer
      scheduler.schedule()                a drafting sequence takes 1 + d tokens (core/spec.py)
      worker.execute                      the verify variant of the one ragged step: logits at
                                          every drafted position, in-jit verification
                                          (sampling/rejection.py)
      speculator.resolve(plan, out, ...)  the accepted tokens one position at a time (stops
                                          checked after each), then pages rolled back

Interplay with the rest of the loop: verify steps are single steps (a decode window declines a
plan with drafts; one runs when no sequence got drafts this step) and they land before the next
plan, so async scheduling overlaps nothing while sequences speculate (the proposer needs every
token; the next positions depend on how many drafts were accepted). Requests that asked for no
speculation (`SamplingParams.speculative=False`), with penalties or structured output decode
plainly in the same steps; while a request with penalties runs or waits no row speculates (the
verify step has no penalty-history variant). Speculation needs one data replica on one host.

Back-off: a sequence whose last two verify steps accepted no draft sits out the next 1, 2, 4, then
at most MAX_SKIP proposals (doubling while its drafts keep failing; an accepted draft resets it).
Meanwhile it decodes plainly, in decode windows and with async scheduling when no sequence
drafts: text with little to copy runs at about the speed of plain decoding.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import numpy as np

from jaxinfer.config import EngineConfig
from jaxinfer.config.speculative import SpeculativeConfig
from jaxinfer.core.plan import SchedulerPlan
from jaxinfer.core.scheduler import Scheduler
from jaxinfer.core.sequence import Sequence
from jaxinfer.core.spec import accept_draft, roll_back
from jaxinfer.loader import LoadedModel, load_model
from jaxinfer.sampling.rejection import VerifyOutput
from jaxinfer.sampling.sampler import SamplerOutput
from jaxinfer.spec_decode.draft import DraftModelProposer
from jaxinfer.spec_decode.ngram import NgramProposer
from jaxinfer.spec_decode.proposer import Proposer
from jaxinfer.worker.worker import Worker
from sharding import is_multiprocess

MAX_SKIP = 8  # proposals a sequence sits out at most after rejected drafts (module docstring)


def _may_speculate(seq: Sequence) -> bool:
    params = seq.sampling_params
    return params.speculative and not params.uses_penalties and seq.grammar is None


def _blocked(scheduler: Scheduler) -> bool:
    """A request with penalties is running or may be admitted: no drafts this step."""
    return any(s.sampling_params.uses_penalties for group in (scheduler.running, scheduler.waiting) for s in group)


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int):
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.num_draft_tokens = self.num_accepted_tokens = self.num_verify_steps = 0
        self._misses: dict[int, int] = {}  # seq id -> verify steps in a row that accepted nothing
        self._skip: dict[int, int] = {}  # seq id -> proposals it sits out before drafting again

    def _drafting(self, seq: Sequence) -> bool:
        return _may_speculate(seq) and not self._skip.get(seq.seq_id)

    def warm_up(self) -> float:
        return self.proposer.warm_up()

    def must_land_first(self, scheduler: Scheduler, previous: list[SchedulerPlan]) -> bool:
        """Whether the step in flight must land before the next plan (module docstring)."""
        if any(plan.verifies for plan in previous):
            return True
        return not _blocked(scheduler) and any(self._drafting(s) for s in scheduler.running)

    def propose(self, scheduler: Scheduler) -> None:
        """Sets the drafts of every running sequence for the next schedule() (most are [])."""
        running = scheduler.running
        live = {s.seq_id for s in running}
        for seq in running:
            seq.draft_token_ids = []
        self.proposer.release(live)
        for seq_id in [i for i in self._misses if i not in live]:
            self._misses.pop(seq_id)
            self._skip.pop(seq_id, None)
        seqs, caps = [], []
        for seq in running if not _blocked(scheduler) else ():
            # Drafts never take a sequence past max_tokens or the context (with the bonus token).
            cap = min(
                self.k,
                seq.sampling_params.max_tokens - seq.num_output_tokens - 1,
                self.max_model_len - seq.num_tokens - 1,
            )
            if (
                cap > 0
                and self._drafting(seq)
                and not seq.num_pending
                and seq.num_tokens - seq.num_computed_tokens == 1
            ):
                seqs.append(seq)
                caps.append(cap)
        for seq_id, left in list(self._skip.items()):  # this proposal sat out
            if left > 1:
                self._skip[seq_id] = left - 1
            else:
                del self._skip[seq_id]
        if seqs:
            for seq, cap, drafts in zip(seqs, caps, self.proposer.propose(seqs, caps)):
                seq.draft_token_ids = [int(t) for t in drafts[:cap]]

    def resolve(
        self, plan: SchedulerPlan, out: VerifyOutput, scheduler: Scheduler
    ) -> Iterator[tuple[SamplerOutput, set[int]]]:
        """A landed verify step, one position j at a time: (the outputs at j [S], ids of the
        sequences that got their token j). The caller emits each before the next is accepted,
        so a stop string found in token j drops the tokens after it."""
        sampled, accepted = out.sampled, np.asarray(out.num_accepted)
        tokens = np.asarray(sampled.tokens)  # [S, K+1]
        first = {s.seq_id for s in scheduler.resolve(plan, tokens[:, 0])}
        yield jax.tree.map(lambda a: a[:, 0], sampled), first
        rows = [(r, e) for r, e in enumerate(plan.seqs) if e.drafts and e.seq.seq_id in first]
        for j in range(1, self.k + 1):
            updated = {e.seq.seq_id for r, e in rows if accepted[r] >= j and accept_draft(scheduler, e, tokens[r, j])}
            if updated:
                yield jax.tree.map(lambda a: a[:, j], sampled), updated  # noqa: B023 - used at once
        for r, e in rows:
            seq = e.seq
            seq.num_draft_tokens += len(e.drafts)
            seq.num_accepted_tokens += int(accepted[r])
            seq.num_verify_steps += 1
            self.num_draft_tokens += len(e.drafts)
            self.num_accepted_tokens += int(accepted[r])
            self.num_verify_steps += 1
            misses = self._misses[seq.seq_id] = 0 if accepted[r] else self._misses.get(seq.seq_id, 0) + 1
            if misses >= 2:
                self._skip[seq.seq_id] = min(2 ** (misses - 2), MAX_SKIP)
            roll_back(scheduler.kv_cache, seq)

    def stats(self) -> dict:
        drafted, accepted, steps = self.num_draft_tokens, self.num_accepted_tokens, self.num_verify_steps
        return {
            "spec_draft_tokens": drafted,
            "spec_accepted_tokens": accepted,
            "spec_verify_steps": steps,
            "spec_acceptance_rate": accepted / drafted if drafted else 0.0,
            "spec_mean_accepted_length": 1 + accepted / steps if steps else 0.0,
            **self.proposer.stats(),
        }


def build_speculator(config: EngineConfig, model: LoadedModel, worker: Worker, max_model_len: int) -> Speculator | None:
    """The Speculator of `config.speculative_config` (None: speculation off)."""
    spec = config.speculative_config
    if spec is None:
        return None
    if worker.num_replicas > 1:
        raise ValueError(
            "speculative_config: speculative decoding needs a single data replica "
            f"(the mesh has data={worker.num_replicas})"
        )
    if is_multiprocess():
        raise ValueError("speculative_config: speculative decoding runs on one host only")
    if spec.method == "ngram":
        proposer: Proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    else:
        dtype = str(model.params.embed.dtype)
        draft = load_model(spec.model, dtype, with_tokenizer=False)
        proposer = DraftModelProposer(
            draft, model, config, max_model_len, worker.num_pages, spec.num_speculative_tokens
        )
    return Speculator(spec, proposer, max_model_len)
