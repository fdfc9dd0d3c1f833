"""OpenAI request bodies -> what the engine takes: prompt token ids and one SamplingParams.

Plain functions, no I/O (tokenizing runs on a worker thread). Every user error is a 400 APIError
naming the request's own field (`max_completion_tokens`, `top_logprobs`, `prompt[1]`), even when
the check is SamplingParams' or serving.model_limits', which name the engine's fields.

    completions: prompt -> prompts.py (token ids per prompt); chat: messages -> messages.py
    -> request fields -> SamplingParams kwargs (sampling_table.py; response_format / guided_*
       -> StructuredOutput; tools -> serving.tools) -> check_request per prompt -> EngineInputs
"""

from __future__ import annotations

import dataclasses
import re

from jaxinfer.core.requests import CheckedRequest
from jaxinfer.sampling import SamplingParams, StructuredOutput
from jaxinfer.sampling.params import logit_bias_from_json
from jaxinfer.tokenizer import Tokenizer
from jaxinfer.tokenizer.tool_calls import ToolCallParser
from serving.errors import RequestError
from serving.model_limits import ModelLimits, check_request, with_kv_transfer
from serving.openai.beam import beam_params, beam_request
from serving.openai.errors import APIError, bad_request, named_400
from serving.openai.messages import render_messages
from serving.openai.prompts import as_list, completion_prompts
from serving.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from serving.openai.sampling_table import SAMPLING_TABLE
from serving.tools import ToolRequest, sampling_updates, tool_request

# Request fields that are SamplingParams fields of the same name and meaning (sampling_table.py).
_SAME_NAME = SAMPLING_TABLE.same_name()
_PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")
_PENALTY_OFF = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left


@dataclasses.dataclass(frozen=True)
class EngineInputs:
    """One HTTP request as engine requests: one per prompt, all with the same params, each
    checked as the engine checks requests (serving/model_limits.py), once."""

    requests: list[CheckedRequest]
    params: SamplingParams
    echo_texts: list[str] | None = None  # completions with echo: each prompt's text
    tools: ToolRequest | None = None  # chat with tools whose output is read for calls
    echo_top: int | None = None  # completions with echo and logprobs=N: the prompt's too
    prompt_logprobs_field: bool = False  # the request's prompt_logprobs: the `prompt_logprobs` field

    @property
    def prompts(self) -> list[list[int]]:
        return [r.prompt_token_ids for r in self.requests]


def completion_inputs(req: CompletionRequest, tokenizer: Tokenizer | None, limits: ModelLimits) -> EngineInputs:
    _refuse_unsupported(req)
    if req.suffix:
        raise bad_request("suffix", "suffix: not supported by this server")
    if req.best_of is not None and req.best_of not in (1, req.n or 1):
        raise bad_request("best_of", f"best_of={req.best_of}: only best_of == n is supported")
    prompts = completion_prompts(req.prompt, tokenizer, limits)
    fields = ["prompt"] if len(prompts) == 1 else [f"prompt[{i}]" for i in range(len(prompts))]
    if req.use_beam_search:  # serving/openai/beam.py
        beam, shown = beam_params(req)
        return EngineInputs([beam_request(ids, beam, limits, f) for ids, f in zip(prompts, fields)], shown)
    names = {"logprobs": "logprobs", "max_tokens": "max_tokens", "structured_output": _structured_field(req)}
    kwargs = _sampling_kwargs(req, limits, logprobs=req.logprobs)
    echo_top = req.logprobs if req.echo and _is_count(req.logprobs) else None
    if echo_top is not None and not limits.prompt_logprobs_enabled:
        raise bad_request(
            "echo",
            "echo with logprobs: the prompt's logprobs are off on this server (start it with --enable-prompt-logprobs)",
        )
    if echo_top is not None and (req.prompt_logprobs is None or _is_count(req.prompt_logprobs)):
        kwargs["prompt_logprobs"] = max(echo_top, req.prompt_logprobs or 0)  # the prompt's tokens too
        names["prompt_logprobs"] = "prompt_logprobs" if req.prompt_logprobs is not None else "echo"
    # echo with max_tokens 0 scores the prompt alone, as vLLM allows (the engine generates
    # nothing, and the prompt may fill the context); without echo there is nothing to return.
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens", "max_tokens=0: must be >= 1 (0 only with echo, which scores the prompt)")
    kwargs["max_tokens"] = COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    params = _params(kwargs, names)
    requests = [_checked(ids, params, limits, {**names, "prompt": field}) for ids, field in zip(prompts, fields)]
    echo = None
    if req.echo:
        if tokenizer is None:
            raise bad_request("echo", "echo: this model has no tokenizer to write the prompt as text")
        echo = [
            p if isinstance(p, str) else tokenizer.decode(ids, skip_special_tokens=False)
            for p, ids in zip(as_list(req.prompt), prompts)
        ]
    return EngineInputs(
        requests, params, echo, echo_top=echo_top, prompt_logprobs_field=req.prompt_logprobs is not None
    )


def chat_inputs(
    req: ChatCompletionRequest,
    tokenizer: Tokenizer | None,
    limits: ModelLimits,
    tool_parser: ToolCallParser | None = None,
) -> EngineInputs:
    """`tool_parser`: how the server reads tool calls for tool_choice "auto" (None: not at all)."""
    _refuse_unsupported(req)
    for name in ("functions", "function_call"):
        if getattr(req, name):
            raise bad_request(name, f"{name}: the deprecated function calling is not supported; use tools")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs", "top_logprobs: needs logprobs=true")
    with named_400():
        tools = tool_request(req.tools, req.tool_choice, req.parallel_tool_calls, tool_parser)
    ids = render_messages(
        req.messages,
        tokenizer,
        bool(req.add_generation_prompt),
        tools.tools if tools else None,
        req.chat_template_kwargs,
    )
    max_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens == 0:  # a chat has no prompt to echo: nothing to return
        raise bad_request(max_name, f"{max_name}=0: must be >= 1")
    names = {
        "logprobs": "top_logprobs",
        "max_tokens": max_name,
        "structured_output": _structured_field(req),
        "prompt": "messages",
    }
    kwargs = _sampling_kwargs(req, limits, logprobs=(req.top_logprobs or 0) if req.logprobs else None)
    cap = min(limits.max_request_tokens or limits.max_model_len, limits.max_model_len)
    # By default, the rest of the context; at least one token (a chat that fills the context is refused).
    kwargs["max_tokens"] = max(1, cap - len(ids)) if max_tokens is None else max_tokens
    if tools is not None and tools.mode != "none":
        _tool_sampling(req, tools, kwargs)
        if tools.structured_output is not None:  # a schema llguidance refuses is the tool's
            names["structured_output"] = "tools"
    params = _params(kwargs, names)
    return EngineInputs(
        [_checked(ids, params, limits, names)],
        params,
        tools=tools if tools is not None and tools.mode != "none" else None,
        prompt_logprobs_field=req.prompt_logprobs is not None,
    )


def _tool_sampling(req: ChatCompletionRequest, tools: ToolRequest, kwargs: dict) -> None:
    with named_400():
        kwargs.update(
            sampling_updates(
                tools, kwargs["structured_output"], req.skip_special_tokens is not None, _structured_field(req)
            )
        )


def _refuse_unsupported(req: SamplingFields) -> None:
    fmt = req.response_format
    if fmt is not None and fmt.type not in ("text", "json_object", "json_schema"):
        raise bad_request(
            "response_format", f'response_format.type={fmt.type!r}: unknown; use "text", "json_object" or "json_schema"'
        )
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options", "stream_options: only allowed with stream=true")


def _sampling_kwargs(req: SamplingFields, limits: ModelLimits, logprobs: int | None) -> dict:
    if not limits.penalties_enabled:
        for name in _PENALTIES:
            value = getattr(req, name)
            if value is not None and value != _PENALTY_OFF[name]:
                raise bad_request(
                    name, f"{name}={value}: penalties are off on this server (started with --no-penalties)"
                )
    kwargs = {name: getattr(req, name) for name in _SAME_NAME if getattr(req, name) is not None}
    if req.stop is not None:
        kwargs["stop"] = req.stop
    if req.stop_token_ids:
        kwargs["stop_token_ids"] = req.stop_token_ids
    kwargs["logprobs"] = logprobs
    kwargs["structured_output"] = _structured_output(req)
    try:
        kwargs["logit_bias"] = logit_bias_from_json(req.logit_bias)  # {"50256": -100}: string keys
    except ValueError as e:
        raise bad_request("logit_bias", str(e)) from None
    return kwargs


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _structured_field(req: SamplingFields) -> str:
    """The request field that asked for structured output (for error messages)."""
    return next(iter(_structured_asked(req)), "response_format")


def _structured_asked(req: SamplingFields) -> dict:
    """{field: value} of every guided_* field set, and response_format when it is not text."""
    asked = {name: getattr(req, name) for name in _GUIDED if getattr(req, name) is not None}
    if req.response_format is not None and req.response_format.type != "text":
        asked["response_format"] = req.response_format
    return asked


def _structured_output(req: SamplingFields) -> StructuredOutput | None:
    """response_format json_object / json_schema, or one guided_* field (vLLM's extras)."""
    asked = _structured_asked(req)
    if not asked:
        return None
    if len(asked) > 1:
        names = sorted(asked)
        raise bad_request(names[1], f"{names[1]}: only one of {', '.join(names)} may be given")
    ((field, value),) = asked.items()
    try:
        if field != "response_format":
            return StructuredOutput(**{_GUIDED[field]: value})
        if value.type == "json_object":
            return StructuredOutput(json_object=True)
        schema = (value.json_schema or {}).get("schema")
        if schema is None:
            raise bad_request("response_format", 'response_format.json_schema.schema: required for type "json_schema"')
        return StructuredOutput(json=schema)
    except ValueError as e:  # "StructuredOutput.regex=...: must be ..."
        raise bad_request(field, f"{field}: {str(e).split(': ', 1)[-1]}") from None


def kv_transfer_inputs(inputs: EngineInputs, req: SamplingFields, limits: ModelLimits) -> EngineInputs:
    """The request's kv_transfer_params (disaggregated prefill/decode, as vllm-router's P/D mode
    sends them) on its one engine request; 400 naming the field."""
    if len(inputs.requests) != 1:
        raise bad_request("kv_transfer_params", "kv_transfer_params: one prompt per request")
    try:
        checked = with_kv_transfer(inputs.requests[0], req.kv_transfer_params, limits)
    except RequestError as e:
        raise bad_request("kv_transfer_params", str(e)) from None
    if checked.kv_transfer is not None and checked.kv_transfer.kind == "produce" and req.stream:
        why = "its answer carries what the decode server needs: not with stream=true"
        raise bad_request("kv_transfer_params", f"kv_transfer_params.do_remote_decode=True: {why}")
    return dataclasses.replace(inputs, requests=[checked])


def _params(kwargs: dict, names: dict[str, str]) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:  # "SamplingParams.top_p=2.0: must be in (0, 1]"
        raise _renamed(str(e).removeprefix("SamplingParams."), names) from None


def _checked(ids: list[int], params: SamplingParams, limits: ModelLimits, names: dict[str, str]) -> CheckedRequest:
    try:
        return check_request(ids, params, limits)
    except RequestError as e:  # "sampling.max_tokens=600: exceeds ...", "prompt of 600 tokens ..."
        raise _renamed(str(e).removeprefix("sampling."), names) from None


def _renamed(message: str, names: dict[str, str]) -> APIError:
    """A message that leads with a SamplingParams field (`top_p=2.0: ...`) or with the prompt
    (`prompt of 600 tokens ...`), led by the request's own field instead."""
    field = m.group(0) if (m := re.match(r"\w+", message)) else "request"  # check_request's lead with one
    ours = names.get(field, field)
    rest = message[len(field) :]
    return bad_request(ours, ours + rest if rest[:1] in ("=", "[", ":", "/") else f"{ours}: {message}")


def _is_count(value: object) -> bool:
    """An int that is not a bool (anything else is left for SamplingParams to name)."""
    return isinstance(value, int) and not isinstance(value, bool)
