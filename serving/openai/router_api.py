"""What routers in front of several servers ask a server (vllm-router, SGLang's model gateway,
llm-d), beside the Prometheus names they scrape (serving/metrics.py, `vllm:*`):

    GET  /get_load                     {"load": requests in the engine, ...}: power_of_two polls it
    GET  /load                         {"server_load": N}, vLLM's name for the same
    GET  /get_server_info              the model, the KV page size (`kv_block_size`): a prefix-aware
                                       router hashes prompts by pages of this size
    GET  /kv_event_sources             {rank: {"endpoint", "topic", "encoding", ...}}: where the
                                       KV events are published (serving/kv_events.py; {} when off)
    POST /v1/completions/render        a request's prompt token ids, as the generation route would
    POST /v1/chat/completions/render   compute them (`{"token_ids": [...]}`; completions: one per
                                       prompt): a router matches them against the KV events

The renders run the generation routes' own checks and tokenization, so a router's view of a
prompt is the tokens the engine caches. All are open except the renders, which take the API key
like the generation routes.
"""

from __future__ import annotations

import functools
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from serving.openai.handlers import ApiContext, parse
from serving.openai.inputs import chat_inputs, completion_inputs
from serving.openai.protocol import ChatCompletionRequest, CompletionRequest

OPEN_ROUTER_PATHS = frozenset({"/get_load", "/load", "/get_server_info", "/kv_event_sources"})
RENDER_PATHS = frozenset({"/v1/completions/render", "/v1/chat/completions/render"})


class RouterEndpoints:
    def __init__(self, ctx: ApiContext, kv_events: Any = None):
        self.ctx, self.kv_events = ctx, kv_events  # kv_events: a serving.kv_events.KVEventPublisher

    def routes(self) -> list[Route]:
        return [
            Route("/get_load", self.get_load, methods=["GET"]),
            Route("/load", self.load, methods=["GET"]),
            Route("/get_server_info", self.server_info, methods=["GET"]),
            Route("/kv_event_sources", self.event_sources, methods=["GET"]),
            Route("/v1/completions/render", self.render_completion, methods=["POST"]),
            Route("/v1/chat/completions/render", self.render_chat, methods=["POST"]),
        ]

    def _load(self) -> dict[str, Any]:
        loop = self.ctx.engine_loop
        stats = loop.last_stats
        return {
            "load": loop.num_requests,
            "num_requests_running": stats.get("running", 0),
            "num_requests_waiting": stats.get("waiting", 0),
            "kv_cache_usage": stats.get("kv_cache_usage", 0.0),
        }

    async def get_load(self, request: Request) -> Response:
        return JSONResponse(self._load())

    async def load(self, request: Request) -> Response:
        return JSONResponse({"server_load": self.ctx.engine_loop.num_requests})

    async def server_info(self, request: Request) -> Response:
        engine = self.ctx.engine_loop.engine
        return JSONResponse(
            {
                "model_id": self.ctx.model_name,
                "model_path": str(engine.model.path),
                "kv_block_size": engine.worker.page_size,
                "max_model_len": self.ctx.limits.max_model_len,
                "data_parallel_size": len(engine.replicas),
                "kv_events": self.kv_events is not None,
            }
        )

    async def event_sources(self, request: Request) -> Response:
        if self.kv_events is None:
            return JSONResponse({})
        return JSONResponse(self.kv_events.sources(request.url.hostname or "127.0.0.1"))

    async def render_completion(self, request: Request) -> Response:
        req = await parse(request, CompletionRequest)
        self.ctx.check_model(req.model)
        inputs = await self.ctx.in_worker(completion_inputs, req, self.ctx.tokenizer, self.ctx.limits)
        return JSONResponse([{"token_ids": ids} for ids in inputs.prompts])

    async def render_chat(self, request: Request) -> Response:
        req = await parse(request, ChatCompletionRequest)
        self.ctx.check_model(req.model)
        to_inputs = functools.partial(chat_inputs, tool_parser=self.ctx.tool_parser)
        inputs = await self.ctx.in_worker(to_inputs, req, self.ctx.tokenizer, self.ctx.limits)
        return JSONResponse({"token_ids": inputs.prompts[0]})
