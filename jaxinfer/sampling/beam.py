"""BeamSearchParams: beam search as vLLM's LLM.beam_search takes it (plain Python).

    LLM.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=32, length_penalty=1.0))

The search is HF transformers' (`generate(num_beams=W, do_sample=False, early_stopping=False)`):
each step every live beam's K = max(2, 1 + #eos) x W likeliest next tokens are candidates (their
log-probabilities added to the beam's); the best W candidates that do not end run on, and those
among the best W that end (an EOS, or max_tokens) join the finished hypotheses, scored by their
summed log-probability over (generated length) ** length_penalty; the search stops when no live
beam can beat the worst of W finished hypotheses (HF's heuristic: the live beam's score at its
current length) or every candidate ends. jaxinfer/core/beam.py runs it over the engine's
sequences; the beams' candidates are the step's top-K logprobs (the sampler's, of the raw logits).
"""

from __future__ import annotations

import dataclasses
import math

from jaxinfer.sampling.params import MAX_LOGPROBS, SamplingParams


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self):
        def bad(name: str, why: str) -> None:
            raise ValueError(f"BeamSearchParams.{name}={getattr(self, name)!r}: {why}")

        if not _is_int(self.beam_width) or self.beam_width < 1:
            bad("beam_width", "must be an integer >= 1")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "must be true or false")
        if self.temperature != 0:
            bad("temperature", "beam search keeps the likeliest beams and samples nothing: it must be 0")
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float)):
            bad("length_penalty", "must be a number")
        if not math.isfinite(self.length_penalty):
            bad("length_penalty", "must be finite")

    def num_candidates(self, num_eos: int) -> int:
        """Candidates kept per step (HF's): enough that W of them go on when the best W all end."""
        return max(2, 1 + (0 if self.ignore_eos else num_eos)) * self.beam_width

    def step_params(self, num_eos: int) -> SamplingParams:
        """How each beam's step samples: greedy (the sampled token is never used), with the
        top-K logprobs the candidates come from; stops are the search's (ignore_eos here)."""
        k = self.num_candidates(num_eos)
        if k > MAX_LOGPROBS:
            most = MAX_LOGPROBS // (k // self.beam_width)
            raise ValueError(
                f"BeamSearchParams.beam_width={self.beam_width}: {k} candidates per beam step exceed the "
                f"{MAX_LOGPROBS} logprobs a step returns (with {num_eos} end-of-sequence ids: beam_width <= {most})"
            )
        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True, logprobs=k)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
