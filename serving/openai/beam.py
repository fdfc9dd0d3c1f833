"""Beam search on the completions route, as vLLM takes it: `use_beam_search: true`, `n` beams.

    {"prompt": "...", "use_beam_search": true, "n": 4, "max_tokens": 32, "length_penalty": 1.0}

Each prompt runs one beam search (jaxinfer/core/beam.py) whose `n` finished beams, best first,
are the prompt's `n` choices. The beams are ranked only once all are done, so the response is
not streamed; sampling fields that would change how tokens are drawn are refused by name
(beam search draws none: temperature must be 0 or left out).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxinfer.core.requests import CheckedRequest, RequestError, check_request
from jaxinfer.sampling.beam import BeamSearchParams
from jaxinfer.sampling.params import SamplingParams
from serving.model_limits import ModelLimits
from serving.openai.errors import bad_request

if TYPE_CHECKING:
    from serving.openai.protocol import CompletionRequest

COMPLETION_MAX_TOKENS = 16  # OpenAI's default max_tokens for completions (as serving/openai/inputs.py's)
_REFUSED = (  # fields that change how tokens are drawn or streamed; their neutral values pass
    ("stream", "echo", "logprobs", "top_p", "top_k", "min_p", "seed", "stop", "logit_bias", "prompt_logprobs")
    + ("presence_penalty", "frequency_penalty", "repetition_penalty", "response_format", "guided_json")
    + ("guided_regex", "guided_choice", "speculative")
)
_NEUTRAL = {"top_p": 1, "top_k": -1, "speculative": True, "echo": False, "stream": False}


def beam_params(req: CompletionRequest) -> tuple[BeamSearchParams, SamplingParams]:
    """The request's BeamSearchParams, and the SamplingParams the response is written with (n)."""
    for name in _REFUSED:
        value = getattr(req, name, None)
        if value is not None and value != _NEUTRAL.get(name) and value not in ([], {}):
            why = "not available with use_beam_search (the beams are ranked when all are done)"
            raise bad_request(name, f"{name}={value!r}: {why}")
    try:
        beam = BeamSearchParams(
            beam_width=req.n or 1,
            max_tokens=COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens,
            ignore_eos=bool(req.ignore_eos),
            temperature=req.temperature or 0.0,
            length_penalty=1.0 if req.length_penalty is None else req.length_penalty,
        )
    except ValueError as e:
        field = str(e).split("=", 1)[0].removeprefix("BeamSearchParams.")
        field = {"beam_width": "n"}.get(field, field)
        message = str(e).replace("BeamSearchParams.beam_width", "n").replace("BeamSearchParams.", "")
        raise bad_request(field, message) from None
    return beam, SamplingParams(n=beam.beam_width, max_tokens=beam.max_tokens)


def beam_request(ids: list[int], beam: BeamSearchParams, limits: ModelLimits, field: str) -> CheckedRequest:
    """One prompt's beam search, checked as the engine checks requests."""
    try:
        return check_request(ids, beam, limits.requests)
    except RequestError as e:
        message = str(e).replace("BeamSearchParams.beam_width", "n").removeprefix("SamplingParams.")
        if e.field == "prompt":
            raise bad_request(field, f"{field}: {message}") from None
        raise bad_request("n" if e.field == "beam_width" else e.field, message) from None
