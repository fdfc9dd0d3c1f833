"""The jaxinfer.v1.InferenceService handlers, on the asyncio event loop.

Generate, for one call:
    reserve a slot (UNAVAILABLE while draining; RESOURCE_EXHAUSTED past the in-flight limit, or
       past the key's requests per minute / concurrency cap, with `retry-after` trailing metadata)
    -> tokenize / render the chat / validate on a worker thread (INVALID_ARGUMENT naming the field)
    -> charge the key's tokens per minute: prompt + max_tokens x n (RESOURCE_EXHAUSTED past them)
    -> EngineLoop.submit(ids, params, sink) where sink puts into this call's asyncio.Queue through
       loop.call_soon_threadsafe (the engine thread never touches asyncio objects directly)
    -> await deltas until finished, merging whatever queued up while the client was slow,
       each wait bounded by the call's deadline (DEADLINE_EXCEEDED)
    -> finally, when the call ended early (cancel, disconnect, deadline, error): EngineLoop.abort (the pages
       freed before the next step); always: the key's slot back, unused tokens refunded, a request-log line.
An exception while serving one call ends that call with INTERNAL; nothing else is affected. A call's key is
the bearer token's id (else anonymous); its queue, deadline, end statuses: streaming.py; beam search: beam.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import grpc
import jax
from google.protobuf import json_format

from jaxinfer.core.requests import CheckedRequest
from jaxinfer.engine import Engine
from jaxinfer.outputs import RequestOutput
from jaxinfer.sampling import MAX_LOGPROBS
from jaxinfer.tokenizer.tool_calls import ToolCallParser
from serving.engine_loop import EngineLoop, ServerShuttingDown, merge_deltas
from serving.errors import RequestError
from serving.grpc import convert
from serving.grpc.beam import beam_request
from serving.grpc.lora import LoraCalls
from serving.grpc.proto import jaxinfer_pb2 as pb
from serving.grpc.proto import jaxinfer_pb2_grpc as pb_grpc
from serving.grpc.streaming import Refused, call_deadline, charge, next_items, rate_limited, status_of
from serving.limits import Grant, RateLimited, RateLimiter
from serving.metrics import ServerMetrics
from serving.model_limits import ModelLimits, check_request
from serving.request_log import RequestLog, RequestRecord
from serving.tools import ChatReplies, output_readers

logger = logging.getLogger(__name__)
GENERATE = "/jaxinfer.v1.InferenceService/Generate"


class InferenceServicer(LoraCalls, pb_grpc.InferenceServiceServicer):
    def __init__(
        self,
        engine_loop: EngineLoop,
        *,
        max_waiting: int,
        metrics: ServerMetrics | None = None,
        executor: concurrent.futures.Executor | None = None,
        limiter: RateLimiter | None = None,
        request_log: RequestLog | None = None,
        key_id: str | None = None,
        tool_call_parser: str = "auto",
        reasoning_parser: str | None = None,
    ) -> None:
        engine = engine_loop.engine
        self.tool_parser, self.reasoning = output_readers(engine.tokenizer, tool_call_parser, reasoning_parser)
        self.reasoning_gated = engine.config.load.reasoning_parser is not None  # grammars start after </think>
        self._engine_loop = engine_loop
        self._tokenizer = engine.tokenizer
        self._limits = ModelLimits.of(engine)
        # At most max_num_seqs running plus max_waiting queued calls are admitted at once.
        self.max_in_flight = engine.config.scheduler.max_num_seqs + max_waiting
        self._metrics = metrics
        self._executor = executor or concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="jaxinfer-tok")
        self._streams: dict[str, asyncio.Queue] = {}
        self._model_info = _model_info(engine, self.tool_parser)
        self.draining = False
        self.in_flight_elsewhere: Callable[[], int] = lambda: 0  # the HTTP API's admitted requests
        self.limiter = limiter or RateLimiter()  # per-key limits, shared with the HTTP API
        self.request_log = request_log or RequestLog()
        self.key_id = key_id  # every call's key: the bearer token's id (one shared token), None: anonymous

    @property
    def limits(self) -> ModelLimits:
        return self._limits

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    async def _in_worker(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    async def _refuse(self, context: grpc.aio.ServicerContext, refused: Refused) -> None:
        if self._metrics is not None:
            self._metrics.rejected.labels(code=refused.code.name).inc()
        await context.abort(refused.code, refused.details, trailing_metadata=refused.metadata)

    # --- Generate -------------------------------------------------------------------------------
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        arrival_time = time.monotonic()  # TTFT and queue time count tokenization and queueing too
        request_id = request.request_id or uuid.uuid4().hex
        record = self.request_log.start("grpc", GENERATE, self.key_id)
        record.request_id = request_id
        if record.keep_text:
            record.prompt = _prompt_of(request)
        grant, status = None, "OK"
        try:
            grant = self._admit(request_id)
            async with contextlib.aclosing(
                self._generate(request, request_id, context, arrival_time, record, grant)
            ) as responses:
                async for response in responses:
                    yield response
        except Refused as e:
            status, record.error = e.code.name, e.details
            await self._refuse(context, e)
        except grpc.aio.AbortError:
            raise
        except (asyncio.CancelledError, GeneratorExit):
            status = "CANCELLED"
            raise
        except Exception as e:  # a bug while serving this call: fail it alone
            logger.exception("request %s failed", request_id)
            status, record.error = "INTERNAL", f"request failed: {type(e).__name__}: {e}"
            await self._refuse(context, Refused(grpc.StatusCode.INTERNAL, record.error))
        finally:
            if grant is not None:
                grant.release(record.total_tokens)  # the unused part of max_tokens goes back
            self.request_log.finish(record, status)

    def _admit(self, request_id: str) -> Grant:
        """Draining, the in-flight limit of both transports, a duplicate id, the key's limits."""
        if self.draining:
            raise Refused(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if (in_flight := len(self._streams) + self.in_flight_elsewhere()) >= self.max_in_flight:
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"server busy: {in_flight} requests in flight (limit {self.max_in_flight}); retry later",
            )
        if request_id in self._streams:
            raise Refused(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {request_id!r} is already in flight")
        try:
            return self.limiter.admit(self.key_id)
        except RateLimited as e:
            raise rate_limited(e) from None

    async def _generate(
        self,
        request: pb.GenerateRequest,
        request_id: str,
        context: grpc.aio.ServicerContext,
        arrival_time: float,
        record: RequestRecord,
        grant: Grant,
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """The call's responses; refusals raise Refused. Ended early: the request is aborted."""
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        submitted = finished = False
        try:
            try:
                checked, replies = await self._in_worker(self._prepare, request)
            except RequestError as e:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            record.prompt_tokens, record.lora_adapter = len(checked.prompt_token_ids), request.lora_adapter or None
            charge(grant, len(checked.prompt_token_ids), checked.params)
            loop = asyncio.get_running_loop()
            deadline = call_deadline(context, loop)

            def sink(item: RequestOutput | BaseException) -> None:  # on the engine thread
                loop.call_soon_threadsafe(queue.put_nowait, item)

            self._engine_loop.submit(request_id, checked, sink, arrival_time)
            submitted = True
            while not finished:
                deltas, error = await next_items(queue, deadline, loop)
                if deltas:
                    out = merge_deltas(deltas)
                    record.observe(0, out)
                    finished = out.finished
                    yield convert.response(out, replies)
                if error is not None:
                    finished = True  # the engine loop has already let go of it
                    raise status_of(error)
        finally:
            self._streams.pop(request_id, None)
            if submitted and not finished:
                self._engine_loop.abort(request_id)

    def _prepare(self, request: pb.GenerateRequest) -> tuple[CheckedRequest, ChatReplies | None]:
        """Worker thread: the request checked as the engine checks requests (once, here), and how
        a chat's output is read (tools, reasoning; None: not)."""
        params = convert.sampling_params(request.sampling)
        tools = convert.chat_tools(request.chat, self.tool_parser) if request.HasField("chat") else None
        ids = convert.prompt_token_ids(request, self._tokenizer, self._limits, tools)
        params = convert.with_tools(params, tools, request.sampling)
        field = request.WhichOneof("prompt") or "prompt"
        if request.HasField("beam_search"):  # serving/grpc/beam.py
            return self.with_lora(request.lora_adapter, beam_request(request, ids, self._limits)), None
        checked = check_request(ids, params, self._limits, request.priority, prompt_field=field)
        replies = convert.chat_replies(request, tools, self.reasoning, params.structured_output, self.reasoning_gated)
        return self.with_lora(request.lora_adapter, convert.kv_transfer_of(request, checked, self._limits)), replies

    # --- unary RPCs -----------------------------------------------------------------------------
    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        if (tokenizer := self._tokenizer) is None:
            return await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this model has no tokenizer")  # raises
        kind = request.WhichOneof("input")
        add = request.add_special_tokens if request.HasField("add_special_tokens") else True
        try:
            if kind == "chat":
                ids = await self._in_worker(convert.render_chat, tokenizer, request.chat)
            elif kind == "text":
                ids = await self._in_worker(tokenizer.encode, request.text, add)
            else:
                raise RequestError("input: set text or chat")
        except RequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.TokenizeResponse(token_ids=ids)

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        if (tokenizer := self._tokenizer) is None:
            return await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this model has no tokenizer")  # raises
        vocab = self._limits.vocab_size
        bad = [t for t in request.token_ids if not 0 <= t < vocab]
        if bad:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"token_ids: ids out of range [0, {vocab}): {bad[:5]}"
            )
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = await self._in_worker(tokenizer.decode, list(request.token_ids), skip)
        return pb.DetokenizeResponse(text=text)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        return self._model_info

    async def GetServerStats(
        self, request: pb.GetServerStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServerStatsResponse:
        try:
            stats, steps = await asyncio.wrap_future(
                self._engine_loop.call(lambda engine: (engine.stats(), self._engine_loop.num_steps))
            )
        except ServerShuttingDown as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return pb.GetServerStatsResponse(
            running=stats["running"],
            waiting=stats["waiting"],
            active_streams=len(self._streams),
            kv_pages_total=stats["kv_pages_total"],
            kv_pages_free=stats["kv_pages_free"],
            kv_cache_usage=stats["kv_cache_usage"],
            prefix_cache_hit_rate=stats["prefix_cache_hit_rate"],
            preemptions=stats["preemptions"],
            compiled_variants=stats["compiled_variants"],
            steps=steps,
        )


def _prompt_of(request: pb.GenerateRequest) -> str | dict[str, Any] | None:
    """The prompt as sent (for a request log with prompts): text, {"ids": [...]} or {"messages": [...]}."""
    kind = request.WhichOneof("prompt")
    return json_format.MessageToDict(request, preserving_proto_field_name=True).get(kind) if kind else None


def _model_info(engine: Engine, tool_parser: ToolCallParser | None) -> pb.GetModelInfoResponse:
    model, tok, cfg = engine.model, engine.tokenizer, engine.config
    eos = tok.eos_token_ids if tok is not None else model.config.eos_token_ids
    dtype = next((str(leaf.dtype) for leaf in jax.tree.leaves(model.params)), "")
    return pb.GetModelInfoResponse(
        model=str(model.path),
        model_type=model.config.model_type,
        dtype=dtype,
        vocab_size=model.config.vocab_size,
        max_model_len=engine.max_model_len,
        eos_token_ids=list(eos),
        has_tokenizer=tok is not None,
        has_chat_template=getattr(tok, "chat_template", None) is not None,
        page_size=cfg.cache.page_size,
        kv_pages_total=engine.kv_cache.num_usable_pages,
        max_num_seqs=cfg.scheduler.max_num_seqs,
        max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
        penalties_enabled=cfg.compile.penalties,
        max_logprobs=MAX_LOGPROBS,
        tool_call_format=tool_parser.name if tool_parser else "",
        prompt_logprobs_enabled=cfg.compile.enable_prompt_logprobs,
    )
