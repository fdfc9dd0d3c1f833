"""What both transports check a request against before it is queued: the model's limits
(vocabulary, context, n, max_request_tokens, which optional features the engine compiled) and
a SamplingParams checked against them.

    ModelLimits.of(engine)             once, when a server starts
    check_params(params, limits, len)  per request, on a worker thread (structured-output specs
                                       compile here, so the engine thread never waits on one)

Errors are RequestErrors whose message names the SamplingParams field (`sampling.max_tokens=600:
...`); each transport renames the field to its own (the gRPC request's `sampling.` fields, the
HTTP API's request fields). Free of protobuf and of HTTP, so both transports share it.
"""
from __future__ import annotations

import dataclasses

from jaxinfer.sampling import SamplingParams
from jaxinfer.sampling.params import check_logit_bias_vocab
from jaxinfer.structured import GrammarBackend
from serving.errors import RequestError


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

    @classmethod
    def of(cls, engine) -> "ModelLimits":
        """The limits of a running Engine."""
        cfg = engine.config
        return cls(vocab_size=engine.model.config.vocab_size, max_model_len=engine.max_model_len,
                   penalties_enabled=cfg.compile.penalties, max_n=cfg.scheduler.max_n,
                   max_request_tokens=cfg.scheduler.max_request_tokens,
                   grammars=engine.grammars, prompt_logprobs_enabled=cfg.compile.enable_prompt_logprobs)


def check_params(params: SamplingParams, limits: ModelLimits, num_prompt_tokens: int) -> None:
    """RequestError naming the field when `params` asks for more than the model and the server give."""
    if params.n > limits.max_n:
        raise RequestError(f"sampling.n={params.n}: exceeds this server's max_n={limits.max_n}")
    total = num_prompt_tokens + params.max_tokens
    if limits.max_request_tokens is not None and total > limits.max_request_tokens:
        raise RequestError(f"sampling.max_tokens={params.max_tokens}: with the prompt's {num_prompt_tokens} "
                           f"tokens that is {total} tokens, more than max_request_tokens={limits.max_request_tokens}")
    if total > limits.max_model_len:
        raise RequestError(f"sampling.max_tokens={params.max_tokens}: with the prompt's {num_prompt_tokens} "
                           f"tokens that is {total} tokens, more than max_model_len={limits.max_model_len}")
    try:
        check_logit_bias_vocab(params, limits.vocab_size)
    except ValueError as e:  # "SamplingParams.logit_bias[50257]: token ids out of ..."
        raise RequestError(f"sampling.{str(e).removeprefix('SamplingParams.')}") from None
    if params.uses_penalties and not limits.penalties_enabled:
        raise RequestError("sampling.repetition_penalty/presence_penalty/frequency_penalty: penalties "
                           "are off on this server (started with --no-penalties)")
    if params.prompt_logprobs is not None and not limits.prompt_logprobs_enabled:
        raise RequestError(f"sampling.prompt_logprobs={params.prompt_logprobs}: prompt logprobs are off on "
                           "this server (start it with --enable-prompt-logprobs)")
    if params.structured_output is not None:
        if limits.grammars is None:
            raise RequestError("sampling.structured_output: this model has no tokenizer to constrain")
        try:
            limits.grammars.compile(params.structured_output)
        except ValueError as e:  # "StructuredOutput.regex: invalid regex ..."
            raise RequestError(f"sampling.structured_output: {str(e).removeprefix('StructuredOutput.')}") from None
