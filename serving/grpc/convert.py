"""Between the wire and the engine: GenerateRequest -> (token ids, SamplingParams), RequestOutput
deltas -> GenerateResponse. Plain functions, no I/O; every user error is a RequestError that
names the request field, which the servicer returns as INVALID_ARGUMENT. What a request is checked
against once converted (ModelLimits, check_params) is serving.model_limits, which the HTTP API
shares.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from typing import Any

from jaxinfer.core.requests import CheckedRequest
from jaxinfer.outputs import Logprob, RequestOutput
from jaxinfer.sampling import SamplingParams, StructuredOutput
from jaxinfer.tokenizer import Tokenizer
from jaxinfer.tokenizer.chat_template import check_template_kwargs
from jaxinfer.tokenizer.reasoning import ReasoningParser
from jaxinfer.tokenizer.tool_calls import ToolCallParser
from serving import tools as serving_tools
from serving.errors import RequestError
from serving.grpc.proto import jaxinfer_pb2 as pb
from serving.model_limits import ModelLimits, with_kv_transfer
from serving.sampling_fields import FieldMapping, SamplingTable
from serving.tools import ChatReplies, ToolRequest

_OPTIONAL = "an `optional` scalar of the same name; unset: the SamplingParams default"
# SamplingOptions -> SamplingParams, field by field (serving.sampling_fields). Every SamplingParams
# field is on the wire today: the proto mirrors them one to one.
SAMPLING_TABLE = SamplingTable(
    "gRPC SamplingOptions",
    mapped=(
        *(
            FieldMapping((name,), name, _OPTIONAL)
            for name in (
                "n",
                "max_tokens",
                "temperature",
                "top_k",
                "top_p",
                "min_p",
                "repetition_penalty",
                "presence_penalty",
                "frequency_penalty",
                "seed",
                "ignore_eos",
                "logprobs",
                "include_stop_str_in_output",
                "skip_special_tokens",
                "speculative",
                "prompt_logprobs",
            )
        ),
        FieldMapping(("stop",), "stop", "repeated string -> tuple"),
        FieldMapping(("stop_token_ids",), "stop_token_ids", "repeated int32 -> tuple"),
        FieldMapping(("logit_bias",), "logit_bias", "map<int32, double> -> dict; empty: None"),
        FieldMapping(
            ("structured_output",),
            "structured_output",
            "StructuredOutput message: its oneof json_schema (JSON text) | json_object | regex | "
            "choice.choices | grammar -> StructuredOutput; unset: None",
        ),
    ),
)
_SCALAR_FIELDS = tuple(m.params for m in SAMPLING_TABLE.mapped if m.conversion == _OPTIONAL)


def sampling_params(options: pb.SamplingOptions) -> SamplingParams:
    kwargs = {name: getattr(options, name) for name in _SCALAR_FIELDS if options.HasField(name)}
    kwargs["stop"] = tuple(options.stop)
    kwargs["stop_token_ids"] = tuple(options.stop_token_ids)
    kwargs["logit_bias"] = dict(options.logit_bias) or None
    try:
        if options.HasField("structured_output"):
            kwargs["structured_output"] = _structured(options.structured_output)
        return SamplingParams(**kwargs)
    except ValueError as e:  # SamplingParams names the field: "SamplingParams.top_p=2.0: ..."
        raise RequestError(f"sampling.{str(e).removeprefix('SamplingParams.')}") from None


def sampling_options(params: SamplingParams) -> pb.SamplingOptions:
    """The request message of a SamplingParams (clients): sampling_params() gives it back."""
    options = pb.SamplingOptions(
        **{name: getattr(params, name) for name in _SCALAR_FIELDS if getattr(params, name) is not None},
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        logit_bias=params.logit_bias or {},
    )
    if params.structured_output is not None:
        options.structured_output.CopyFrom(structured_message(params.structured_output))
    return options


def _structured(message: pb.StructuredOutput) -> StructuredOutput:
    kind = message.WhichOneof("kind")
    if kind is None:
        raise ValueError(
            "SamplingParams.structured_output: set one of json_schema, json_object, regex, choice, grammar"
        )
    try:
        if kind == "json_schema":
            return StructuredOutput(json=message.json_schema)
        if kind == "choice":
            return StructuredOutput(choice=tuple(message.choice.choices))
        return StructuredOutput(**{kind: getattr(message, kind)})
    except ValueError as e:  # "StructuredOutput.regex=...: ..." -> the request's field name
        raise ValueError(f"SamplingParams.structured_output.{str(e).removeprefix('StructuredOutput.')}") from None


def structured_message(spec: StructuredOutput) -> pb.StructuredOutput:
    """The request message of a StructuredOutput (clients)."""
    if spec.json is not None:
        return pb.StructuredOutput(json_schema=json.dumps(spec.json))
    if spec.choice is not None:
        return pb.StructuredOutput(choice=pb.StructuredOutput.Choices(choices=list(spec.choice)))
    return pb.StructuredOutput(**{spec.kind: getattr(spec, spec.kind)})


def render_chat(tokenizer: Tokenizer, chat: pb.Chat, tools: ToolRequest | None = None) -> list[int]:
    """Chat template -> token ids, exactly as LLM.render_chat does it (tools included: the
    chat's, checked here unless `tools` has them already)."""
    if not chat.messages:
        raise RequestError("chat.messages: empty")
    if getattr(tokenizer, "chat_template", None) is None:
        raise RequestError("chat: this model has no chat template")
    messages = [_chat_message(m, i) for i, m in enumerate(chat.messages)]
    tool_list = None if tools is None else tools.tools
    if tool_list is None and (raw := json_field(chat.tools_json, "chat.tools_json")) is not None:
        with _in_chat():
            tool_list = serving_tools.checked_tools(raw)
    try:
        extra = check_template_kwargs(json_field(chat.chat_template_kwargs_json, "chat.chat_template_kwargs_json"))
    except ValueError as e:
        raise RequestError(f"chat.{e}") from None
    add = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add, tools=tool_list, **extra)
    except Exception as e:  # a template may raise on roles it does not know
        raise RequestError(f"chat.messages: the chat template rejected them: {e}") from None
    return tokenizer.encode(text, add_special_tokens=False)


def chat_tools(chat: pb.Chat, parser: ToolCallParser | None) -> ToolRequest | None:
    """The chat's tools and tool_choice (a name: that function), checked; None without tools."""
    choice: str | dict[str, Any] | None = chat.tool_choice or None
    if choice not in (None, "none", "auto", "required"):
        choice = {"type": "function", "function": {"name": choice}}
    parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else None
    with _in_chat():
        return serving_tools.tool_request(json_field(chat.tools_json, "chat.tools_json"), choice, parallel, parser)


def with_tools(params: SamplingParams, tools: ToolRequest | None, sampling: pb.SamplingOptions) -> SamplingParams:
    """The params with what the tool choice sets (structured output, special tokens kept)."""
    if tools is None or tools.mode == "none":
        return params
    updates = serving_tools.sampling_updates(
        tools, params.structured_output, sampling.HasField("skip_special_tokens"), "sampling.structured_output"
    )
    return dataclasses.replace(params, **updates)


def chat_replies(
    request: pb.GenerateRequest,
    tools: ToolRequest | None,
    reasoning: ReasoningParser | None,
    structured_output: StructuredOutput | None = None,
    engine_gated: bool = False,
) -> ChatReplies | None:
    """How a request's output is read as it finishes: a chat with a tool choice other than none,
    or any chat on a server with a reasoning parser (serving.tools.reasoning_for); None for
    everything else."""
    reading = tools if tools is not None and tools.mode != "none" else None
    if reading is None and (reasoning is None or not request.HasField("chat")):
        return None
    return ChatReplies(reading, serving_tools.reasoning_for(reasoning, structured_output, engine_gated))


def _chat_message(m: pb.ChatMessage, i: int) -> dict:
    entry: dict[str, Any] = {"role": m.role, "content": m.content}
    calls = json_field(m.tool_calls_json, f"chat.messages[{i}].tool_calls_json")
    if calls is not None:
        if not isinstance(calls, list):
            raise RequestError(f"chat.messages[{i}].tool_calls_json: must be a JSON list of calls")
        entry["tool_calls"] = [
            serving_tools.template_call(c, f"chat.messages[{i}].tool_calls_json[{j}]") for j, c in enumerate(calls)
        ]
    for key in ("tool_call_id", "name"):
        if getattr(m, key):
            entry[key] = getattr(m, key)
    return entry


def json_field(text: str, field: str) -> Any:  # a JSON value
    """A JSON-text field's value; None when it is empty."""
    if not text:
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise RequestError(f"{field}: not valid JSON ({e})") from None


@contextlib.contextmanager
def _in_chat():
    """serving.tools' errors ("tools[0].type=...") named as the chat's fields ("chat.tools[0].type")."""
    try:
        yield
    except RequestError as e:
        raise RequestError(f"chat.{e}") from None


def prompt_token_ids(
    request: pb.GenerateRequest, tokenizer: Tokenizer | None, limits: ModelLimits, tools: ToolRequest | None = None
) -> list[int]:
    """The prompt as token ids, checked against the vocabulary (`tools`:
    a chat's, from chat_tools)."""
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise RequestError("prompt: set one of text, token_ids or chat")
    if kind == "token_ids":
        ids = list(request.token_ids.ids)
        if not ids:
            raise RequestError("token_ids.ids: the prompt is empty")
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise RequestError(f"token_ids.ids: ids out of range [0, {limits.vocab_size}): {bad[:5]}")
        return ids  # its length against the context: model_limits.check_request (so are the others)
    if tokenizer is None:
        raise RequestError(f"{kind}: this model has no tokenizer; send prompt token_ids")
    if kind == "text":
        if not request.text:
            raise RequestError("text: the prompt is empty")
        return tokenizer.encode(request.text)
    return render_chat(tokenizer, request.chat, tools)


def kv_transfer_of(request: pb.GenerateRequest, checked: CheckedRequest, limits: ModelLimits) -> CheckedRequest:
    """GenerateRequest.kv_transfer_params: JSON text (disaggregated prefill/decode), checked."""
    params = json_field(request.kv_transfer_params, "kv_transfer_params")  # None when empty
    return checked if params is None else with_kv_transfer(checked, params, limits)


def response(out: RequestOutput, replies: ChatReplies | None = None) -> pb.GenerateResponse:
    """`replies`: a chat read for reasoning or tools: its finishing deltas carry what was read."""
    msg = pb.GenerateResponse(
        request_id=out.request_id,
        finished=out.finished,
        usage=pb.Usage(
            prompt_tokens=out.usage.prompt_tokens,
            completion_tokens=out.usage.completion_tokens,
            cached_prompt_tokens=out.usage.cached_prompt_tokens,
            host_cached_prompt_tokens=out.usage.host_cached_prompt_tokens,
            draft_tokens=out.metrics.num_draft_tokens,
            accepted_draft_tokens=out.metrics.num_accepted_tokens,
        ),
    )
    msg.kv_transfer_params = json.dumps(out.kv_transfer_params) if out.kv_transfer_params is not None else ""
    for c in out.outputs:
        delta = msg.outputs.add(index=c.index, text=c.text, token_ids=c.token_ids, finish_reason=c.finish_reason or "")
        if isinstance(c.stop_reason, str):
            delta.stop_string = c.stop_reason
        elif c.stop_reason is not None:
            delta.stop_token_id = int(c.stop_reason)
        delta.logprobs.extend(map(_token_logprob, c.logprobs or ()))
        read = None if replies is None else replies.add(c.index, c.text, c.finish_reason is not None)
        if read is not None:
            thought, parsed = read
            if thought is not None:
                delta.reasoning_content = thought
            delta.content = parsed.content or ""
            delta.tool_calls.extend(
                pb.ToolCall(id=serving_tools.new_call_id(), name=call.name, arguments=call.arguments)
                for call in parsed.tool_calls
            )
    msg.prompt_logprobs.extend(_token_logprob(lp) for lp in (out.prompt_logprobs or [None])[1:] if lp is not None)
    if out.finished:
        m = out.metrics
        itl = m.inter_token_latencies
        msg.timings.CopyFrom(
            pb.Timings(
                queue_time_s=m.queue_time or 0.0,
                time_to_first_token_s=m.time_to_first_token or 0.0,
                e2e_latency_s=m.e2e_latency or 0.0,
                mean_inter_token_latency_s=sum(itl) / len(itl) if itl else 0.0,
            )
        )
    return msg


def _token_logprob(lp: Logprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        rank=lp.rank or 0,
        top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top.items()],
    )
