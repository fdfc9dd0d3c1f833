"""OutputProcessor: a request's sampled tokens in, streamed RequestOutput deltas out.

    Engine.step(): scheduler.update(plan, tokens) appended each sampled token to its Sequence;
      on_token(state, sample, out, row, scheduler)
        -> the token's logprobs (when asked for), its text (IncrementalDetokenizer),
           stop strings (finishing the sequence through the scheduler when one appears)
      delta(state, now)
        -> RequestOutput with what is new since the last delta, usage and timings

Stop strings are found in the detokenized text, so they live here: text that could still turn
into a stop string is held back (at most the longest stop string minus one character) until the
sequence finishes or the text moves past it. A stop string cuts the text exactly, with or
without the stop string itself (`include_stop_str_in_output`).
"""
from __future__ import annotations

import dataclasses

from jaxinfer.core.plan import SchedulerPlan
from jaxinfer.core.scheduler import Scheduler
from jaxinfer.core.sequence import Sequence, SequenceStatus
from jaxinfer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, Usage
from jaxinfer.sampling.params import SamplingParams
from jaxinfer.sampling.prompt_logprobs import PromptLogprobs
from jaxinfer.sampling.sampler import SamplerOutput
from jaxinfer.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclasses.dataclass
class SampleState:
    """What one sample (Sequence) has produced and how much of it was already emitted."""

    seq: Sequence
    detok: IncrementalDetokenizer | None  # None: the engine has no tokenizer (ids only)
    text: str = ""  # all text so far (cut at a stop string once found)
    emitted_chars: int = 0
    emitted_tokens: int = 0
    logprobs: list[Logprob] = dataclasses.field(default_factory=list)
    emitted_logprobs: int = 0


@dataclasses.dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]
    metrics: RequestMetrics
    cached_prompt_tokens: int = 0
    replica: int = 0
    cost: int = 0  # tokens it may occupy: (prompt + max_tokens) * n
    # SamplingParams.prompt_logprobs: each prompt token's, as its rows land (None: not asked).
    prompt_logprobs: list[Logprob | None] | None = None
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(s.seq.is_finished for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer

    def new_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, seqs: list[Sequence], metrics: RequestMetrics, *,
                    replica: int = 0, cost: int = 0) -> RequestState:
        samples = [SampleState(seq, self._detokenizer(prompt_token_ids, params)) for seq in seqs]
        return RequestState(request_id, prompt, prompt_token_ids, params, samples, metrics,
                            replica=replica, cost=cost,
                            prompt_logprobs=None if params.prompt_logprobs is None else [None])

    @staticmethod
    def on_prompt_rows(plan: SchedulerPlan, out: PromptLogprobs, requests: dict[str, RequestState]) -> None:
        """Records the prompt logprobs a step scored (inputs.prompt_inputs chose its rows); a
        position already recorded (a preempted prompt computed again) is skipped."""
        offset = 0
        for e in plan.seqs:
            state, seq = requests.get(e.seq.request_id), e.seq
            recorded = state.prompt_logprobs if state is not None and seq.sample_index == 0 else None
            if recorded is not None and e.start <= len(recorded) - 1:  # in order (Sequence.cacheable_pages)
                n = state.params.prompt_logprobs
                for p in range(max(e.start, len(recorded) - 1), min(e.kv_len, seq.num_prompt_tokens - 1)):
                    row = offset + p - e.start
                    recorded.append(Logprob(seq.token_ids[p + 1], float(out.logprobs[row]),
                                            _top(out, row, n), int(out.ranks[row])))
                seq.num_scored_prompt = len(recorded) - 1
            offset += e.num_new_tokens

    def _detokenizer(self, prompt_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)

    def on_token(self, state: RequestState, sample: SampleState, out: SamplerOutput, row: int,
                 scheduler: Scheduler) -> None:
        """Records the token the scheduler just put into `sample.seq` (row `row` of `out`)."""
        seq, params, token = sample.seq, state.params, int(out.tokens[row])
        if params.logprobs is not None:
            sample.logprobs.append(Logprob(token, float(out.logprobs[row]), _top(out, row, params.logprobs)))
        if sample.detok is None:
            return
        sample.text += sample.detok.step([token])
        if seq.is_finished:
            sample.text += sample.detok.flush()
        if params.stop and seq.status is not SequenceStatus.FINISHED_STOPPED:
            _check_stop_strings(sample, params, scheduler)

    def delta(self, state: RequestState, now: float) -> RequestOutput:
        """What is new for the request since its last delta; marks its timings."""
        completions = [_completion_delta(i, s, state.params) for i, s in enumerate(state.samples)]
        m = state.metrics
        if new := max((len(c.token_ids) for c in completions), default=0):
            if m.first_token_time is None:
                m.first_token_time = m.last_token_time = now
                new -= 1
            if new:  # tokens that came together (a decode window) share the gap evenly
                m.inter_token_latencies += [(now - m.last_token_time) / new] * new
            m.last_token_time = now
        seqs = [s.seq for s in state.samples]
        m.num_draft_tokens = sum(s.num_draft_tokens for s in seqs)
        m.num_accepted_tokens = sum(s.num_accepted_tokens for s in seqs)
        m.num_verify_steps = sum(s.num_verify_steps for s in seqs)
        finished = state.finished
        if finished:
            m.finished_time = now
        usage = Usage(prompt_tokens=len(state.prompt_token_ids),
                      completion_tokens=sum(len(s.seq.known_output_ids) for s in state.samples),
                      cached_prompt_tokens=state.cached_prompt_tokens)
        prompt_logprobs = None
        if (state.prompt_logprobs is not None and not state.prompt_logprobs_sent
                and len(state.prompt_logprobs) == len(state.prompt_token_ids)):
            prompt_logprobs, state.prompt_logprobs_sent = state.prompt_logprobs, True
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions,
                             finished, usage, m, prompt_logprobs)


def _top(out: SamplerOutput | PromptLogprobs, row: int, n: int) -> dict[int, float]:
    """Row `row`'s n most likely tokens and their logprobs (sampled or prompt rows alike)."""
    return {int(i): float(lp) for i, lp in zip(out.top_ids[row][:n], out.top_logprobs[row][:n])}


def _check_stop_strings(sample: SampleState, params: SamplingParams, scheduler: Scheduler) -> None:
    longest = max(len(s) for s in params.stop)
    # Only text that arrived this step (plus an overlap) can complete a new stop string.
    search_from = max(0, sample.emitted_chars - longest)
    hits = [(sample.text.find(s, search_from), s) for s in params.stop]
    hits = [(i, s) for i, s in hits if i >= 0]
    if not hits:
        return
    index, stop = min(hits)
    sample.text = sample.text[: index + (len(stop) if params.include_stop_str_in_output else 0)]
    if not sample.seq.is_finished:
        scheduler.finish(sample.seq, SequenceStatus.FINISHED_STOPPED, stop_reason=stop)
    else:
        sample.seq.stop_reason = stop
        sample.seq.status = SequenceStatus.FINISHED_STOPPED


def _completion_delta(index: int, s: SampleState, params: SamplingParams) -> CompletionOutput:
    seq = s.seq
    hold = 0 if seq.is_finished or not params.stop else max(len(x) for x in params.stop) - 1
    upto = max(s.emitted_chars, len(s.text) - hold)
    out = CompletionOutput(
        index=index, text=s.text[s.emitted_chars:upto],
        token_ids=seq.known_output_ids[s.emitted_tokens:],  # never a placeholder of a step in flight
        logprobs=s.logprobs[s.emitted_logprobs:] if params.logprobs is not None else None,
        finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
    s.emitted_chars, s.emitted_tokens, s.emitted_logprobs = upto, len(seq.known_output_ids), len(s.logprobs)
    return out
