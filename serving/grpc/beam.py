"""Beam search over gRPC: GenerateRequest.beam_search (jaxinfer/core/beam.py does the search).

    GenerateRequest(text=..., sampling=SamplingOptions(max_tokens=32), beam_search=BeamSearch(beam_width=4))

The request's sampling options give max_tokens and ignore_eos (temperature may be 0); any other
option set is refused by name, since beam search draws no token. The final response holds the
beam_width beams, best first; nothing is streamed before (the beams are ranked when all are done).
"""

from __future__ import annotations

from jaxinfer.core.requests import CheckedRequest, RequestError, check_request
from jaxinfer.sampling.beam import BeamSearchParams
from serving import errors
from serving.grpc.proto import jaxinfer_pb2 as pb
from serving.model_limits import ModelLimits

ALLOWED = {"max_tokens", "ignore_eos", "temperature"}


def beam_request(request: pb.GenerateRequest, ids: list[int], limits: ModelLimits) -> CheckedRequest:
    """The request's beam search, checked as the engine checks requests."""
    options, spec = request.sampling, request.beam_search
    for field, _ in options.ListFields():
        if field.name not in ALLOWED:
            raise errors.RequestError(f"sampling.{field.name}: not available with beam_search (it draws no token)")
    try:
        beam = BeamSearchParams(
            beam_width=spec.beam_width,
            max_tokens=options.max_tokens if options.HasField("max_tokens") else 16,
            ignore_eos=options.ignore_eos,
            temperature=options.temperature,
            length_penalty=spec.length_penalty if spec.HasField("length_penalty") else 1.0,
        )
        return check_request(ids, beam, limits.requests, priority=request.priority)
    except RequestError as e:
        message = str(e).removeprefix("SamplingParams.")
        if e.field == "prompt":
            raise errors.RequestError(f"{request.WhichOneof('prompt') or 'prompt'}: {message}") from None
        raise errors.RequestError(f"beam_search.{message.removeprefix('BeamSearchParams.')}") from None
    except ValueError as e:  # "BeamSearchParams.beam_width=0: ..."
        field = str(e).removeprefix("BeamSearchParams.")
        where = "sampling" if field.startswith(("max_tokens", "temperature", "ignore_eos")) else "beam_search"
        raise errors.RequestError(f"{where}.{field}") from None
