"""What the engine hands back: per-request outputs (deltas or whole), usage and timings."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass
class Logprob:
    token_id: int
    logprob: float
    top: dict[int, float]  # the requested top-N tokens of this position and their logprobs
    rank: int | None = None  # prompt logprobs: 1 + the tokens the model found more likely

    def as_dict(self) -> dict[int, float]:
        """vLLM's shape of a position: {token id: logprob} of the token and the top-N."""
        return {**self.top, self.token_id: self.logprob}

    def to_json(self) -> dict:
        """{"token_id", "logprob", ["rank",] "top_logprobs": {"id": logprob}} (the CLI's JSON lines)."""
        rank = {} if self.rank is None else {"rank": self.rank}
        return {
            "token_id": self.token_id,
            "logprob": self.logprob,
            **rank,
            "top_logprobs": {str(t): v for t, v in self.top.items()},
        }


def logprobs_json(logprobs: Sequence[Logprob | None] | None) -> list[dict | None] | None:
    """A list of logprobs as JSON values (None entries, such as a prompt's first, stay null)."""
    return None if logprobs is None else [None if lp is None else lp.to_json() for lp in logprobs]


@dataclasses.dataclass
class CompletionOutput:
    """One of a request's n samples. In a streamed delta, text/token_ids/logprobs are the new part."""

    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[Logprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    cumulative_logprob: float | None = None  # a beam search's hypotheses: the summed logprob of token_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.monotonic) and derived latencies of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    inter_token_latencies: list[float] = dataclasses.field(default_factory=list)
    # Speculative decoding, summed over the request's samples: draft tokens verified, how many of
    # them the target accepted, and in how many verify steps.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens (None: nothing was drafted)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verify step emitted on average: its accepted drafts plus the one it samples."""
        return 1 + self.num_accepted_tokens / self.num_verify_steps if self.num_verify_steps else None

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclasses.dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    host_cached_prompt_tokens: int = 0  # of those, tokens whose pages the host tier kept (kv_offload_gb)


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    usage: Usage
    metrics: RequestMetrics
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing
    # predicts it); in the first output (delta) once the prompt is computed, else None.
    prompt_logprobs: list[Logprob | None] | None = None
    # Disaggregated prefill/decode: what a decode server needs to pull this prefill's KV pages
    # (in the final output of a request sent with kv_transfer_params {do_remote_decode: true}).
    kv_transfer_params: dict[str, Any] | None = None

    def merge(self, delta: RequestOutput) -> None:
        """Appends a streamed delta of the same request to this accumulated output."""
        for mine, new in zip(self.outputs, delta.outputs):
            mine.text += new.text
            mine.token_ids += new.token_ids
            if new.logprobs is not None:
                mine.logprobs = (mine.logprobs or []) + new.logprobs
            mine.finish_reason, mine.stop_reason = new.finish_reason, new.stop_reason
        self.finished, self.usage, self.metrics = delta.finished, delta.usage, delta.metrics
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.kv_transfer_params is not None:
            self.kv_transfer_params = delta.kv_transfer_params


@dataclasses.dataclass
class BeamSearchSequence:
    """One finished beam of LLM.beam_search: its generated tokens and text, summed logprob and
    length-penalised score (what ranks the beams), and why it ended ("stop": an EOS; "length")."""

    token_ids: list[int]
    text: str
    cum_logprob: float
    score: float
    finish_reason: str | None


@dataclasses.dataclass
class BeamSearchOutput:
    """LLM.beam_search's result for one prompt: its beams, best first."""

    sequences: list[BeamSearchSequence]
    prompt: str | None = None
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, out: RequestOutput, length_penalty: float) -> BeamSearchOutput:
        """From the finished RequestOutput of a beam search (one CompletionOutput per beam)."""
        beams = [
            BeamSearchSequence(
                o.token_ids,
                o.text,
                o.cumulative_logprob or 0.0,
                (o.cumulative_logprob or 0.0) / max(1, len(o.token_ids)) ** length_penalty,
                o.finish_reason,
            )
            for o in out.outputs
        ]
        return cls(beams, out.prompt, out.prompt_token_ids)
