"""Python clients of jaxinfer.v1.InferenceService: `Client` (blocking) and `AsyncClient` (asyncio).

    with Client("127.0.0.1:50051", token=...) as client:
        result = client.generate("Hello", max_tokens=32, temperature=0)    # accumulated
        for msg in client.stream([1, 2, 3], max_tokens=8): ...              # GenerateResponse deltas
        client.generate(messages=[{"role": "user", "content": "Hi"}])       # chat template
        client.generate(messages=..., tools=[...], tool_choice="required").outputs[0].tool_calls

Sampling options are keyword arguments named as in SamplingParams (and the proto's
SamplingOptions); leaving one out takes the server's default. Failures raise grpc.RpcError with
the server's status code and message. Leaving a stream early cancels the call, which aborts the
request on the server and frees its KV pages.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.grpc.proto import jaxinfer_pb2 as pb
from serving.grpc.proto import jaxinfer_pb2_grpc as pb_grpc

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
    **sampling: object,
) -> pb.GenerateRequest:
    """`tools` (OpenAI's list), `tool_choice` ("auto", "none", "required" or a tool's name) and
    `chat_template_kwargs` go with `messages`; with tools the result's completions carry
    `tool_calls` and `content`."""
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
        sampling=pb.SamplingOptions(**{k: v for k, v in sampling.items() if v is not None}),
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
    else:
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


def _tokenize_request(text, messages, add_special_tokens: bool) -> pb.TokenizeRequest:
    request = pb.TokenizeRequest(add_special_tokens=add_special_tokens)
    if messages is not None:
        request.chat.CopyFrom(_chat(messages))
    else:
        request.text = text
    return request


class Accumulator:
    """Folds streamed GenerateResponse deltas into one GenerateResult."""

    def __init__(self):
        self.request_id = ""
        self.outputs: dict[int, Completion] = {}
        self.usage, self.timings = pb.Usage(), pb.Timings()
        self.prompt_logprobs: list[pb.TokenLogprob] = []

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

    def result(self) -> GenerateResult:
        return GenerateResult(
            self.request_id,
            [self.outputs[i] for i in sorted(self.outputs)],
            self.usage,
            self.timings,
            self.prompt_logprobs,
        )


def _channel_args(max_message_bytes: int):
    return [("grpc.max_receive_message_length", max_message_bytes), ("grpc.max_send_message_length", max_message_bytes)]


class _Base:
    def __init__(
        self, target: str, token: str | None, root_certificates: bytes | None, tls_server_name: str | None, tls: bool
    ):
        self.target = target
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._tls = tls or root_certificates is not None
        self._creds = grpc.ssl_channel_credentials(root_certificates=root_certificates) if self._tls else None
        self._options = _channel_args(64 * 1024 * 1024)
        if tls_server_name:
            self._options.append(("grpc.ssl_target_name_override", tls_server_name))


class Client(_Base):
    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        token: str | None = None,
        root_certificates: bytes | None = None,
        tls_server_name: str | None = None,
        tls: bool = False,
    ):
        super().__init__(target, token, root_certificates, tls_server_name, tls)
        self.channel = (
            grpc.secure_channel(target, self._creds, self._options)
            if self._tls
            else grpc.insecure_channel(target, self._options)
        )
        self.stub = pb_grpc.InferenceServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def stream(
        self, prompt: Prompt | None = None, *, timeout: float | None = None, **kwargs: object
    ) -> Iterator[pb.GenerateResponse]:
        call = self.stub.Generate(build_request(prompt, **kwargs), timeout=timeout, metadata=self._metadata)
        try:
            yield from call
        finally:
            call.cancel()  # a no-op once finished; aborts the request when the caller stops early

    def generate(
        self, prompt: Prompt | None = None, *, timeout: float | None = None, **kwargs: object
    ) -> GenerateResult:
        acc = Accumulator()
        for msg in self.stream(prompt, timeout=timeout, **kwargs):
            acc.add(msg)
        return acc.result()

    def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Iterable[dict] | None = None,
        add_special_tokens: bool = True,
        timeout: float | None = None,
    ) -> list[int]:
        request = _tokenize_request(text, messages, add_special_tokens)
        return list(self.stub.Tokenize(request, timeout=timeout, metadata=self._metadata).token_ids)

    def detokenize(
        self, token_ids: Sequence[int], *, skip_special_tokens: bool = True, timeout: float | None = None
    ) -> str:
        request = pb.DetokenizeRequest(token_ids=list(token_ids), skip_special_tokens=skip_special_tokens)
        return self.stub.Detokenize(request, timeout=timeout, metadata=self._metadata).text

    def model_info(self, timeout: float | None = None) -> pb.GetModelInfoResponse:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, metadata=self._metadata)

    def server_stats(self, timeout: float | None = None) -> pb.GetServerStatsResponse:
        return self.stub.GetServerStats(pb.GetServerStatsRequest(), timeout=timeout, metadata=self._metadata)

    def health(self, service: str = "", timeout: float | None = None) -> str:
        reply = self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(_Base):
    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        token: str | None = None,
        root_certificates: bytes | None = None,
        tls_server_name: str | None = None,
        tls: bool = False,
    ):
        super().__init__(target, token, root_certificates, tls_server_name, tls)
        self.channel = (
            grpc.aio.secure_channel(target, self._creds, self._options)
            if self._tls
            else grpc.aio.insecure_channel(target, self._options)
        )
        self.stub = pb_grpc.InferenceServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    async def stream(
        self, prompt: Prompt | None = None, *, timeout: float | None = None, **kwargs: object
    ) -> AsyncIterator[pb.GenerateResponse]:
        call = self.stub.Generate(build_request(prompt, **kwargs), timeout=timeout, metadata=self._metadata)
        try:
            async for msg in call:
                yield msg
        finally:
            call.cancel()

    async def generate(
        self, prompt: Prompt | None = None, *, timeout: float | None = None, **kwargs: object
    ) -> GenerateResult:
        acc = Accumulator()
        async for msg in self.stream(prompt, timeout=timeout, **kwargs):
            acc.add(msg)
        return acc.result()

    async def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Iterable[dict] | None = None,
        add_special_tokens: bool = True,
        timeout: float | None = None,
    ) -> list[int]:
        request = _tokenize_request(text, messages, add_special_tokens)
        reply = await self.stub.Tokenize(request, timeout=timeout, metadata=self._metadata)
        return list(reply.token_ids)

    async def detokenize(
        self, token_ids: Sequence[int], *, skip_special_tokens: bool = True, timeout: float | None = None
    ) -> str:
        request = pb.DetokenizeRequest(token_ids=list(token_ids), skip_special_tokens=skip_special_tokens)
        return (await self.stub.Detokenize(request, timeout=timeout, metadata=self._metadata)).text

    async def model_info(self, timeout: float | None = None) -> pb.GetModelInfoResponse:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, metadata=self._metadata)

    async def server_stats(self, timeout: float | None = None) -> pb.GetServerStatsResponse:
        return await self.stub.GetServerStats(pb.GetServerStatsRequest(), timeout=timeout, metadata=self._metadata)

    async def health(self, service: str = "", timeout: float | None = None) -> str:
        reply = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
