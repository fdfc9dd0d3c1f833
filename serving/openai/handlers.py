"""The generation endpoints, /v1/completions and /v1/chat/completions, kept thin:

    parse the body (400 naming the field) -> the model must be ours (404)
    -> request -> prompts + SamplingParams on a worker thread (inputs.py; 400 naming the field)
    -> stream: SSEResponse over the engine's deltas as chunks (outputs.ChunkWriter), `[DONE]` last;
       an error after the first byte is one `data: {"error": ...}` event before `[DONE]`
    -> not streamed: the whole outputs, unless the client disconnects first (then aborted)
Admission (in-flight limit, the key's requests per minute and concurrency) happened in the
middleware, before any of this; the key's tokens per minute are charged here, once the prompts and
max_tokens are known (429). The request's record (request log) is filled in on the way: id, user,
prompt tokens, each delta, the message of an error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any

import pydantic
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxinfer.lora.registry import AdapterEntry
from jaxinfer.lora.request import LoRARequest
from jaxinfer.outputs import RequestOutput
from jaxinfer.tokenizer import Tokenizer
from jaxinfer.tokenizer.reasoning import ReasoningParser
from jaxinfer.tokenizer.tool_calls import ToolCallParser
from serving.engine_loop import EngineLoop
from serving.model_limits import ModelLimits
from serving.openai import outputs, sse
from serving.openai.admission import charge_tokens
from serving.openai.errors import APIError, bad_request, from_validation, unknown_model
from serving.openai.generation import EngineRequests, unless_disconnected
from serving.openai.inputs import EngineInputs, chat_inputs, completion_inputs, kv_transfer_inputs
from serving.openai.protocol import ChatCompletionRequest, CompletionRequest
from serving.request_log import RequestRecord
from serving.tools import reasoning_for

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ApiContext:
    """What every endpoint shares: the engine loop, the model's facts, a worker pool."""

    engine_loop: EngineLoop
    tokenizer: Tokenizer | None
    limits: ModelLimits
    model_name: str
    executor: concurrent.futures.Executor
    tool_parser: ToolCallParser | None = None  # how tool_choice "auto" outputs are read (None: refused)
    reasoning: ReasoningParser | None = None  # splits chat outputs' reasoning_content off (None: not)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    lora_updates: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter are served

    def __post_init__(self):
        self.texts = outputs.TokenTexts(self.tokenizer)

    async def in_worker[R](self, fn: Callable[..., R], *args: Any) -> R:
        """CPU work (tokenizing, chat templates) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))

    def adapters(self) -> dict[str, AdapterEntry]:
        """The LoRA adapters a request may name as its model, by name: the engine's own list, so
        an adapter loaded or unloaded over gRPC is known here at once (a snapshot of a dict the
        engine thread changes, taken whole under the GIL, as the gRPC servicer reads it)."""
        manager = self.engine_loop.engine.lora if self.engine_loop is not None else None
        return {e.name: e for e in manager.adapters} if manager is not None else {}

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names (None: the base model); 404 for a name
        that is neither."""
        if model is None or model == self.model_name:
            return None
        adapters = self.adapters()
        if model in adapters:
            return LoRARequest(model, adapters[model].int_id)
        raise unknown_model(model, self.model_name, sorted(adapters))


async def parse[Body: pydantic.BaseModel](request: Request, model: type[Body]) -> Body:
    try:
        data = json.loads(await request.body())
    except ValueError as e:
        raise bad_request(None, f"the body is not valid JSON: {e}") from None
    except RecursionError:  # [[[[...]]]]: nested deeper than the parser goes
        raise bad_request(None, "the body is not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise bad_request(None, "the body must be a JSON object")
    try:
        body = model.model_validate(data)
    except pydantic.ValidationError as e:
        raise from_validation(e) from None
    if body.model_extra:
        logger.debug("%s: ignoring fields %s", request.url.path, sorted(body.model_extra))
    return body


def _noting_errors(handler):
    """The handler, writing the message of an APIError it raises into the request's record."""

    @functools.wraps(handler)
    async def noting(ctx: ApiContext, request: Request) -> Response:
        try:
            return await handler(ctx, request)
        except APIError as e:
            if (record := _record(request)) is not None:
                record.error = e.message
            raise

    return noting


async def _prepared[B: (CompletionRequest, ChatCompletionRequest)](
    ctx: ApiContext,
    request: Request,
    body_cls: type[B],
    to_inputs: Callable[[B, Tokenizer | None, ModelLimits], EngineInputs],
) -> tuple[float, B, EngineInputs]:
    """(arrival time, parsed body, EngineInputs) of a generation request; the prompt is
    tokenized and the sampling values checked on a worker thread."""
    arrival = time.monotonic()
    req = await parse(request, body_cls)
    lora = ctx.check_model(req.model)
    inputs = await ctx.in_worker(to_inputs, req, ctx.tokenizer, ctx.limits)
    if lora is not None:
        inputs = dataclasses.replace(inputs, requests=[dataclasses.replace(r, lora=lora) for r in inputs.requests])
    if req.kv_transfer_params is not None:  # disaggregated prefill/decode
        inputs = kv_transfer_inputs(inputs, req, ctx.limits)
    return arrival, req, inputs


def _served(ctx: ApiContext, req: CompletionRequest | ChatCompletionRequest) -> str:
    """The model a response names: the adapter asked for, else the base model (check_model let
    the request through: its `model` is one or the other)."""
    return req.model or ctx.model_name


@_noting_errors
async def completions(ctx: ApiContext, request: Request) -> Response:
    arrival, req, inputs = await _prepared(ctx, request, CompletionRequest, completion_inputs)
    head = outputs.ResponseHeader(f"cmpl-{uuid.uuid4().hex}", "text_completion", int(time.time()), _served(ctx, req))
    record = _admitted(request, head.id, req, inputs, lambda: req.prompt)
    if req.stream:
        writer = outputs.ChunkWriter(
            head, inputs.params.n, ctx.texts, _include_usage(req), inputs.echo_texts, shown=_shown(inputs)
        )
        return sse.SSEResponse(_events(ctx, inputs, writer, arrival, record))
    requests = EngineRequests(ctx.engine_loop, head.id, inputs, arrival, record)
    results = await unless_disconnected(request.receive, _collect(requests))
    body = outputs.completion_response(head, results, inputs.params.n, ctx.texts, inputs.echo_texts, _shown(inputs))
    return JSONResponse(_with_kv_transfer(body, results))


@_noting_errors
async def chat_completions(ctx: ApiContext, request: Request) -> Response:
    to_inputs = functools.partial(chat_inputs, tool_parser=ctx.tool_parser)
    arrival, req, inputs = await _prepared(ctx, request, ChatCompletionRequest, to_inputs)
    head = outputs.ResponseHeader(
        f"chatcmpl-{uuid.uuid4().hex}", "chat.completion", int(time.time()), _served(ctx, req)
    )
    record = _admitted(request, head.id, req, inputs, lambda: [m.model_dump(exclude_none=True) for m in req.messages])
    reasoning = reasoning_for(
        ctx.reasoning, inputs.params.structured_output, ctx.engine_loop.engine.config.load.reasoning_parser is not None
    )
    if req.stream:
        head.object = "chat.completion.chunk"
        writer = outputs.ChunkWriter(
            head,
            inputs.params.n,
            ctx.texts,
            _include_usage(req),
            tools=inputs.tools,
            reasoning=reasoning,
            shown=_shown(inputs),
        )
        return sse.SSEResponse(_events(ctx, inputs, writer, arrival, record))
    requests = EngineRequests(ctx.engine_loop, head.id, inputs, arrival, record)
    (result,) = await unless_disconnected(request.receive, _collect(requests))
    body = outputs.chat_response(head, result, ctx.texts, inputs.tools, reasoning, _shown(inputs))
    return JSONResponse(_with_kv_transfer(body, [result]))


def _with_kv_transfer(body: dict, results: list) -> dict:
    """A prefill's answer carries what its decode server pulls with (vLLM's top-level field)."""
    params = results[0].kv_transfer_params if len(results) == 1 else None
    return body if params is None else {**body, "kv_transfer_params": params}


def _shown(inputs: EngineInputs) -> outputs.PromptShown:
    return outputs.PromptShown(inputs.echo_top, inputs.prompt_logprobs_field)


async def _collect(requests: EngineRequests) -> list:
    async with requests:
        return await requests.collect()


async def _events(
    ctx: ApiContext,
    inputs: EngineInputs,
    writer: outputs.ChunkWriter,
    arrival: float,
    record: RequestRecord | None = None,
) -> AsyncGenerator[bytes, None]:
    """The SSE events of one streamed response. Submitting happens here, on the first read, so
    a response that is never streamed (the client left at once) never reaches the engine."""
    last: dict[int, RequestOutput] = {}
    try:
        async with EngineRequests(ctx.engine_loop, writer.head.id, inputs, arrival, record) as requests:
            for chunk in writer.opening(len(inputs.prompts)):
                yield sse.event(chunk)
            async for i, delta in requests.deltas():
                last[i] = delta  # usage counts are cumulative: the last delta has the totals
                for chunk in writer.deltas(i, delta):
                    yield sse.event(chunk)
        for chunk in writer.closing([last[i] for i in sorted(last)]):
            yield sse.event(chunk)
    except APIError as e:
        logger.warning("stream %s failed: %s", writer.head.id, e.message)
        if record is not None:
            record.error = e.message
        yield sse.event(e.body())
    yield sse.DONE


def _include_usage(req: CompletionRequest | ChatCompletionRequest) -> bool:
    return req.stream_options is not None and bool(req.stream_options.include_usage)


def _record(request: Request) -> RequestRecord | None:
    return request.scope.get("state", {}).get("record")


def _admitted(
    request: Request,
    request_id: str,
    req: CompletionRequest | ChatCompletionRequest,
    inputs: EngineInputs,
    prompt: Callable[[], object],
) -> RequestRecord | None:
    """Logs the request, fills in its record and charges its tokens to its key (429 past the key's
    tokens per minute). `prompt()` is the prompt as sent, for a request log with prompts."""
    state = request.scope.get("state", {})
    logger.info(
        "%s key=%s user=%.64s prompts=%d prompt_tokens=%s",
        request_id,
        state.get("key_id") or "-",
        req.user or "-",
        len(inputs.prompts),
        [len(p) for p in inputs.prompts],
    )
    record = state.get("record")
    if record is not None:
        record.request_id, record.user = request_id, req.user
        record.lora_adapter = inputs.requests[0].lora.lora_name if inputs.requests and inputs.requests[0].lora else None
        record.prompt_tokens = sum(len(p) for p in inputs.prompts)
        if record.keep_text:
            record.prompt = prompt()
    charge_tokens(state.get("grant"), inputs.prompts, inputs.params)
    return record
