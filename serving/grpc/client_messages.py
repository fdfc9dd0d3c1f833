"""What the Python clients send and read back: keyword arguments -> jaxinfer.v1 requests, and a
Generate call's streamed responses -> one result.

    Client.generate(prompt | messages, lora_adapter=NAME, **sampling)
        -> build_request: prompt (text | token ids) or chat (messages, tools, template kwargs),
           the LoRA adapter to run under (by name; "": the base model),
           SamplingOptions from the keyword arguments named as its fields (unknown: TypeError)
        -> GenerateResponse deltas -> Accumulator.add per message -> GenerateResult (one
           Completion per sample: text, token ids, logprobs, tool calls, finish and stop reason)

Plain protobuf, no channel: client.py holds the channels and stubs.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence

from serving.grpc.proto import jaxinfer_pb2 as pb

Prompt = str | Sequence[int]  # text, or token ids
_SAMPLING_FIELDS = frozenset(f.name for f in pb.SamplingOptions.DESCRIPTOR.fields)


@dataclasses.dataclass
class Completion:
    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = dataclasses.field(default_factory=list)
    finish_reason: str = ""
    stop_reason: int | str | None = None
    tool_calls: list[pb.ToolCall] = dataclasses.field(default_factory=list)  # a chat with tools
    content: str | None = None  # beside tool_calls and reasoning_content: the text that is neither
    reasoning_content: str | None = None  # a server with --reasoning-parser: the thinking split off


@dataclasses.dataclass
class GenerateResult:
    request_id: str
    outputs: list[Completion]
    usage: pb.Usage
    timings: pb.Timings
    # sampling prompt_logprobs=N: one per prompt token after the first (with its rank and top-N)
    prompt_logprobs: list[pb.TokenLogprob] = dataclasses.field(default_factory=list)
    kv_transfer_params: dict | None = None  # a prefill's params for its decode server (P/D)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids


def build_request(
    prompt: Prompt | None = None,
    *,
    messages: Iterable[dict] | None = None,
    request_id: str = "",
    priority: int = 0,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    tool_choice: str | None = None,
    parallel_tool_calls: bool | None = None,
    chat_template_kwargs: dict | None = None,
    lora_adapter: str | None = None,
    kv_transfer_params: dict | None = None,
    **sampling: object,
) -> pb.GenerateRequest:
    """`tools` (OpenAI's list), `tool_choice` ("auto", "none", "required" or a tool's name) and
    `chat_template_kwargs` go with `messages`; with tools the result's completions carry
    `tool_calls` and `content`. `lora_adapter`: the LoRA adapter to run under, by name (None or
    "": the base model; an unknown one is INVALID_ARGUMENT). `kv_transfer_params`: disaggregated
    prefill/decode (a prefill's result carries the params of its decode request)."""
    unknown = set(sampling) - _SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling options {sorted(unknown)}; known: {sorted(_SAMPLING_FIELDS)}")
    if (prompt is None) == (messages is None):
        raise ValueError("pass either a prompt (text or token ids) or messages")
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    request = pb.GenerateRequest(
        request_id=request_id,
        priority=priority,
        lora_adapter=lora_adapter or "",
        kv_transfer_params=json.dumps(kv_transfer_params) if kv_transfer_params is not None else "",
        # Each option as protobuf takes it: it checks the types (a TypeError names the field).
        sampling=pb.SamplingOptions(**{k: v for k, v in sampling.items() if v is not None}),  # type: ignore[arg-type]
    )
    if (tools is not None or tool_choice is not None or chat_template_kwargs is not None) and messages is None:
        raise ValueError("tools, tool_choice and chat_template_kwargs go with messages")
    if messages is not None:
        request.chat.CopyFrom(_chat(messages, add_generation_prompt))
        if tools is not None:
            request.chat.tools_json = json.dumps(tools)
        if tool_choice is not None:
            request.chat.tool_choice = tool_choice
        if parallel_tool_calls is not None:
            request.chat.parallel_tool_calls = parallel_tool_calls
        if chat_template_kwargs is not None:
            request.chat.chat_template_kwargs_json = json.dumps(chat_template_kwargs)
    elif isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None:  # token ids (a prompt or messages: checked above)
        request.token_ids.ids.extend(int(t) for t in prompt)
    return request


def _chat(messages: Iterable[dict], add_generation_prompt: bool = True) -> pb.Chat:
    return pb.Chat(messages=[_message(m) for m in messages], add_generation_prompt=add_generation_prompt)


def _message(m: dict) -> pb.ChatMessage:
    """An OpenAI-shaped message (an assistant's tool_calls, a tool result's tool_call_id)."""
    calls = m.get("tool_calls")
    return pb.ChatMessage(
        role=m["role"],
        content=m.get("content") or "",
        tool_call_id=m.get("tool_call_id") or "",
        name=m.get("name") or "",
        tool_calls_json=json.dumps(calls) if calls else "",
    )


def tokenize_request(text: str | None, messages: Iterable[dict] | None, add_special_tokens: bool) -> pb.TokenizeRequest:
    request = pb.TokenizeRequest(add_special_tokens=add_special_tokens)
    if messages is not None:
        request.chat.CopyFrom(_chat(messages))
    elif text is not None:
        request.text = text
    else:
        raise ValueError("pass either text or messages")
    return request


class Accumulator:
    """Folds streamed GenerateResponse deltas into one GenerateResult."""

    def __init__(self):
        self.request_id = ""
        self.outputs: dict[int, Completion] = {}
        self.usage, self.timings = pb.Usage(), pb.Timings()
        self.prompt_logprobs: list[pb.TokenLogprob] = []
        self.kv_transfer_params: dict | None = None

    def add(self, msg: pb.GenerateResponse) -> None:
        self.request_id = msg.request_id
        self.prompt_logprobs += list(msg.prompt_logprobs)
        for d in msg.outputs:
            c = self.outputs.setdefault(d.index, Completion(d.index))
            c.text += d.text
            c.token_ids += list(d.token_ids)
            c.logprobs += list(d.logprobs)
            c.finish_reason = d.finish_reason
            c.tool_calls += list(d.tool_calls)
            if d.HasField("content"):
                c.content = d.content
            if d.HasField("reasoning_content"):
                c.reasoning_content = d.reasoning_content
            kind = d.WhichOneof("stop_reason")
            c.stop_reason = getattr(d, kind) if kind else None
        self.usage.CopyFrom(msg.usage)
        if msg.finished:
            self.timings.CopyFrom(msg.timings)
        if msg.kv_transfer_params:
            self.kv_transfer_params = json.loads(msg.kv_transfer_params)

    def result(self) -> GenerateResult:
        return GenerateResult(
            self.request_id,
            [self.outputs[i] for i in sorted(self.outputs)],
            self.usage,
            self.timings,
            self.prompt_logprobs,
            self.kv_transfer_params,
        )
