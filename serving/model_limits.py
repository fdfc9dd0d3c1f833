"""What both transports check a request against before it is queued, with the engine's own
checks (jaxinfer/core/requests.py): the model's limits (vocabulary, context, KV pool, n,
max_request_tokens, which optional features the engine compiled) and its structured output.

    ModelLimits.of(engine)                once, when a server starts
    check_request(ids, params, limits)    per request, on a worker thread: the CheckedRequest the
                                          engine loop queues as it is (structured-output specs
                                          compile here, so the engine thread never waits on one)
    with_kv_transfer(checked, kv, limits) its kv_transfer_params (disaggregated prefill/decode)

Errors are RequestErrors whose message starts with the field (`sampling.max_tokens=600: ...`,
`prompt of 600 tokens ...`); each transport renames the field to its own (the gRPC request's
`sampling.` fields, the HTTP API's request fields). Free of protobuf and of HTTP, so both
transports share it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from jaxinfer.core import requests as core
from jaxinfer.core.kv_transfer_params import parse_kv_transfer_params
from jaxinfer.core.requests import CheckedRequest, RequestLimits
from jaxinfer.sampling import SamplingParams
from jaxinfer.structured import GrammarBackend
from serving.errors import RequestError

if TYPE_CHECKING:  # the engine imports JAX; these limits are host-side
    from jaxinfer.engine import Engine


@dataclasses.dataclass(frozen=True)
class ModelLimits:
    """What a prompt is checked against before it is queued."""

    vocab_size: int
    max_model_len: int
    penalties_enabled: bool
    max_n: int = 64
    prompt_logprobs_enabled: bool = False
    max_request_tokens: int | None = None  # None: max_model_len
    # The engine's GrammarBackend: structured-output specs are compiled (and cached) by
    # check_params on a worker thread, so the engine thread never waits for a schema.
    grammars: GrammarBackend | None = None
    page_size: int | None = None  # the KV pool of one replica (None: not checked)
    num_usable_pages: int | None = None
    max_num_seqs: int | None = None
    num_eos: int = 0
    no_beam_search: str | None = None
    kv_windows: tuple[int | None, ...] = (None,)  # the KV pool's layer groups (RequestLimits)
    max_chunk: int = 1
    kv_role: str = "both"  # disaggregated prefill/decode: the side(s) this server takes

    @classmethod
    def of(cls, engine: Engine) -> ModelLimits:
        """The limits of a running Engine (its RequestLimits, and its grammar backend)."""
        r = engine.limits
        return cls(
            vocab_size=r.vocab_size,
            max_model_len=r.max_model_len,
            penalties_enabled=r.penalties,
            max_n=r.max_n,
            prompt_logprobs_enabled=r.prompt_logprobs,
            max_request_tokens=r.max_request_tokens,
            grammars=engine.grammars,
            page_size=r.page_size,
            num_usable_pages=r.num_usable_pages,
            max_num_seqs=r.max_num_seqs,
            num_eos=r.num_eos,
            no_beam_search=r.no_beam_search,
            kv_windows=r.kv_windows,
            max_chunk=r.max_chunk,
            kv_role=r.kv_role,
        )

    @property
    def requests(self) -> RequestLimits:
        return RequestLimits(
            self.vocab_size,
            self.max_model_len,
            self.max_request_tokens,
            self.max_n,
            self.penalties_enabled,
            self.prompt_logprobs_enabled,
            self.page_size,
            self.num_usable_pages,
            owner="server",
            max_num_seqs=self.max_num_seqs,
            num_eos=self.num_eos,
            no_beam_search=self.no_beam_search,
            kv_windows=self.kv_windows,
            max_chunk=self.max_chunk,
            kv_role=self.kv_role,
        )


def check_request(
    ids: list[int], params: SamplingParams, limits: ModelLimits, priority: int = 0, *, prompt_field: str = "prompt"
) -> CheckedRequest:
    """The request as the engine loop queues it: every check of the engine (once, here) and the
    structured output compiled. RequestError naming the field (`prompt_field`: the request's
    name for its prompt)."""
    try:
        checked = core.check_request(ids, params, limits.requests, priority=priority)
    except core.RequestError as e:
        raise RequestError(_on_the_wire(e, prompt_field)) from None
    _check_structured(params, limits)
    return checked


def with_kv_transfer(checked: CheckedRequest, kv_transfer_params: Any, limits: ModelLimits) -> CheckedRequest:
    """The request with its kv_transfer_params (disaggregated prefill/decode) read and checked
    against this server's kv_role: RequestError naming the field (`kv_transfer_params.widths=...`)."""
    try:
        kv = parse_kv_transfer_params(kv_transfer_params)
        if kv is None:
            return checked
        core.check_kv_transfer(kv, checked.params, checked.beam, limits.requests)
    except core.RequestError as e:
        raise RequestError(str(e)) from None
    return dataclasses.replace(checked, kv_transfer=kv)


def check_params(params: SamplingParams, limits: ModelLimits, num_prompt_tokens: int) -> None:
    """RequestError naming the field when `params` asks for more than the model and the server give."""
    try:
        core.check_params(params, limits.requests)
        core.check_lengths(num_prompt_tokens, params, limits.requests)
    except core.RequestError as e:
        raise RequestError(_on_the_wire(e)) from None
    _check_structured(params, limits)


def _check_structured(params: SamplingParams, limits: ModelLimits) -> None:
    if params.structured_output is not None:
        if limits.grammars is None:
            raise RequestError("sampling.structured_output: this model has no tokenizer to constrain")
        try:
            limits.grammars.compile(params.structured_output)
        except ValueError as e:  # "StructuredOutput.regex: invalid regex ..."
            raise RequestError(f"sampling.structured_output: {str(e).removeprefix('StructuredOutput.')}") from None


def _on_the_wire(e: core.RequestError, prompt_field: str = "prompt") -> str:
    """The engine's message as the transports word it, led by the field: a SamplingParams field
    as `sampling.field`, the prompt by the request's name for it."""
    message = str(e).removeprefix("SamplingParams.")
    if e.field == "prompt":
        return f"{prompt_field}: {message}"
    if not message.startswith(e.field):
        message = f"{e.field}: {message}"
    return message if e.field == "priority" else f"sampling.{message}"
