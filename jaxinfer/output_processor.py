"""OutputProcessor: a request's sampled tokens in, streamed RequestOutput deltas out.

    Engine.step(): scheduler.resolve(plan, tokens) appends each sampled token to its Sequence
      and decides whether it stops there (core/stops.py), asking `stop_checker(seq)` about
      stop strings: the token's text (IncrementalDetokenizer) and the first stop string in it
      on_tokens(plan, out, updated, requests, touched) -> on_token(state, sample, out, row)
        -> the grammar advanced past the token, its logprobs (when asked for), its text
      delta(state, now)
        -> RequestOutput with what is new since the last delta, usage and timings

Stop strings are found in the detokenized text, so the text is made here; the decision to stop is
the scheduler's, one path for every kind of stop. Text that could still turn into a stop string
is held back (at most the longest stop string minus one character) until the sequence finishes
or the text moves past it. A stop string cuts the text exactly, with or without the stop string
itself (`include_stop_str_in_output`).
"""

from __future__ import annotations

import dataclasses
import logging

from jaxinfer.core.beam import Hypothesis
from jaxinfer.core.plan import SchedulerPlan
from jaxinfer.core.sequence import Sequence, SequenceStatus
from jaxinfer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, Usage
from jaxinfer.sampling.params import SamplingParams
from jaxinfer.sampling.prompt_logprobs import PromptLogprobs
from jaxinfer.sampling.sampler import SamplerOutput
from jaxinfer.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)


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
    num_detokenized: int = 0  # output tokens whose text is in `text`
    stopped: bool = False  # a stop string cut the text: nothing more is added
    cumulative_logprob: float | None = None  # a beam search's hypothesis (core/beam.py)


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
        self._stop_samples: dict[int, tuple[SampleState, SamplingParams]] = {}  # seq id -> with stop strings

    def new_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seqs: list[Sequence],
        metrics: RequestMetrics,
        *,
        replica: int = 0,
        cost: int = 0,
    ) -> RequestState:
        samples = [SampleState(seq, self._detokenizer(prompt_token_ids, params)) for seq in seqs]
        if params.stop and self.tokenizer is not None:
            self._stop_samples.update((s.seq.seq_id, (s, params)) for s in samples)
        return RequestState(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            samples,
            metrics,
            replica=replica,
            cost=cost,
            prompt_logprobs=None if params.prompt_logprobs is None else [None],
        )

    @staticmethod
    def on_prompt_rows(plan: SchedulerPlan, out: PromptLogprobs, requests: dict[str, RequestState]) -> None:
        """Records the prompt logprobs a step scored (inputs.prompt_inputs chose its rows); a
        position already recorded (a preempted prompt computed again) is skipped."""
        offset = 0
        for e in plan.seqs:
            state, seq = requests.get(e.seq.request_id), e.seq
            recorded = state.prompt_logprobs if state is not None and seq.sample_index == 0 else None
            # In order (Sequence.cacheable_pages); a request records them when it asks for them.
            if state is not None and recorded is not None and e.start <= len(recorded) - 1:
                n = state.params.prompt_logprobs or 0
                for p in range(max(e.start, len(recorded) - 1), min(e.kv_len, seq.num_prompt_tokens - 1)):
                    row = offset + p - e.start
                    recorded.append(
                        Logprob(seq.token_ids[p + 1], float(out.logprobs[row]), _top(out, row, n), int(out.ranks[row]))
                    )
                seq.num_scored_prompt = len(recorded) - 1
            offset += e.num_new_tokens

    def _detokenizer(self, prompt_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)

    def stop_checker(self, seq: Sequence) -> str | None:
        """The scheduler's stop check for stop strings: the sequence's new tokens detokenized,
        and the first stop string its text now holds (the text cut there), or None."""
        entry = self._stop_samples.get(seq.seq_id)
        if entry is None:
            return None
        sample, params = entry
        _detokenize(sample)
        stop = _find_stop_string(sample, params)
        if stop is not None:
            sample.stopped = True
        return stop

    def on_tokens(
        self,
        plan: SchedulerPlan,
        out: SamplerOutput,
        updated: set[int],
        requests: dict[str, RequestState],
        touched: dict[str, RequestState],
    ) -> None:
        """The tokens the scheduler just gave the `updated` sequences of `plan` (row i of `out`
        for plan.seqs[i]): each grammar advanced past its token, each token recorded; the
        requests that got one are added to `touched`."""
        for row, entry in enumerate(plan.seqs):
            seq = entry.seq
            state = requests.get(seq.request_id)
            if seq.seq_id not in updated or state is None:
                continue
            if seq.beam is not None:  # a beam search's outputs are its hypotheses, once it is done
                if seq.beam.done and state.samples[0].cumulative_logprob is None:  # not yet made
                    self._beam_results(state, seq.beam.results())
                    touched[seq.request_id] = state
                continue
            token = int(out.tokens[row])
            if seq.grammar is not None and not seq.grammar.consume(token):
                logger.warning(
                    "request %s: the grammar rejected token %d (%s)", seq.request_id, token, seq.grammar.error
                )
            self.on_token(state, state.samples[seq.sample_index], out, row)
            touched[seq.request_id] = state

    def on_token(self, state: RequestState, sample: SampleState, out: SamplerOutput, row: int) -> None:
        """Records the token the scheduler just put into `sample.seq` (row `row` of `out`); a
        request that only scores its prompt (max_tokens=0) got none."""
        seq, params, token = sample.seq, state.params, int(out.tokens[row])
        if params.max_tokens == 0:
            return
        if params.logprobs is not None:
            sample.logprobs.append(Logprob(token, float(out.logprobs[row]), _top(out, row, params.logprobs)))
        if sample.detok is None or sample.stopped:
            return
        _detokenize(sample)
        if seq.is_finished:
            sample.text += sample.detok.flush()

    def _beam_results(self, state: RequestState, hypotheses: list[Hypothesis]) -> None:
        """The request's samples become its finished hypotheses, best first, with their text."""
        state.params = dataclasses.replace(state.params, logprobs=None)  # the candidates were the search's
        samples = []
        for i, h in enumerate(hypotheses):
            seq = Sequence(-1 - i, state.request_id, state.prompt_token_ids, state.params, seed=0, arrival=0)
            seq.token_ids += h.token_ids
            stopped = h.finish_reason == "stop"
            seq.status = SequenceStatus.FINISHED_STOPPED if stopped else SequenceStatus.FINISHED_LENGTH
            sample = SampleState(seq, self._detokenizer(state.prompt_token_ids, state.params))
            sample.cumulative_logprob = h.cum_logprob
            _detokenize(sample)
            if sample.detok is not None:
                sample.text += sample.detok.flush()
            samples.append(sample)
        state.samples = samples

    def forget(self, state: RequestState) -> None:
        """A finished request's samples leave the stop check."""
        for s in state.samples:
            self._stop_samples.pop(s.seq.seq_id, None)

    def delta(self, state: RequestState, now: float) -> RequestOutput:
        """What is new for the request since its last delta; marks its timings."""
        completions = [_completion_delta(i, s, state.params) for i, s in enumerate(state.samples)]
        m = state.metrics
        if new := max((len(c.token_ids) for c in completions), default=0):
            if m.first_token_time is None:
                m.first_token_time = m.last_token_time = now
                new -= 1
            if new and m.last_token_time is not None:  # tokens that came together (a window) share the gap
                m.inter_token_latencies += [(now - m.last_token_time) / new] * new
            m.last_token_time = now
        seqs = [s.seq for s in state.samples]
        m.num_draft_tokens = sum(s.num_draft_tokens for s in seqs)
        m.num_accepted_tokens = sum(s.num_accepted_tokens for s in seqs)
        m.num_verify_steps = sum(s.num_verify_steps for s in seqs)
        finished = state.finished
        if finished:
            m.finished_time = now
        usage = Usage(
            prompt_tokens=len(state.prompt_token_ids),
            completion_tokens=sum(len(s.seq.known_output_ids) for s in state.samples),
            cached_prompt_tokens=state.cached_prompt_tokens,
            host_cached_prompt_tokens=state.samples[0].seq.num_host_hit_tokens if state.cached_prompt_tokens else 0,
        )
        prompt_logprobs = None
        if (
            state.prompt_logprobs is not None
            and not state.prompt_logprobs_sent
            and len(state.prompt_logprobs) == len(state.prompt_token_ids)
        ):
            prompt_logprobs, state.prompt_logprobs_sent = state.prompt_logprobs, True
        return RequestOutput(
            state.request_id, state.prompt, state.prompt_token_ids, completions, finished, usage, m, prompt_logprobs
        )


def _top(out: SamplerOutput | PromptLogprobs, row: int, n: int) -> dict[int, float]:
    """Row `row`'s n most likely tokens and their logprobs (sampled or prompt rows alike)."""
    return {int(i): float(lp) for i, lp in zip(out.top_ids[row][:n], out.top_logprobs[row][:n])}


def _detokenize(sample: SampleState) -> None:
    """Adds the text of the sample's known output tokens not yet detokenized."""
    seq = sample.seq
    start, end = seq.num_prompt_tokens + sample.num_detokenized, seq.num_known_tokens
    if end > start and sample.detok is not None:  # None: no tokenizer, no text
        sample.text += sample.detok.step(seq.token_ids[start:end])
        sample.num_detokenized = end - seq.num_prompt_tokens


def _find_stop_string(sample: SampleState, params: SamplingParams) -> str | None:
    """The first stop string in the sample's text (the text cut there), or None."""
    longest = max(len(s) for s in params.stop)
    # Only text that arrived this step (plus an overlap) can complete a new stop string.
    search_from = max(0, sample.emitted_chars - longest)
    hits = [(sample.text.find(s, search_from), s) for s in params.stop]
    hits = [(i, s) for i, s in hits if i >= 0]
    if not hits:
        return None
    index, stop = min(hits)
    sample.text = sample.text[: index + (len(stop) if params.include_stop_str_in_output else 0)]
    return stop


def _completion_delta(index: int, s: SampleState, params: SamplingParams) -> CompletionOutput:
    seq = s.seq
    hold = 0 if seq.is_finished or not params.stop else max(len(x) for x in params.stop) - 1
    upto = max(s.emitted_chars, len(s.text) - hold)
    out = CompletionOutput(
        index=index,
        text=s.text[s.emitted_chars : upto],
        token_ids=seq.known_output_ids[s.emitted_tokens :],  # never a placeholder of a step in flight
        logprobs=s.logprobs[s.emitted_logprobs :] if params.logprobs is not None else None,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        cumulative_logprob=s.cumulative_logprob,
    )
    s.emitted_chars, s.emitted_tokens, s.emitted_logprobs = upto, len(seq.known_output_ids), len(s.logprobs)
    return out
