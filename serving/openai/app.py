"""The ASGI app of the OpenAI-compatible API: its routes and how errors become OpenAI's JSON.

    POST /v1/completions, /v1/chat/completions   handlers.py (streamed or not)
    GET  /v1/models, /v1/models/{model}          the served model and its LoRA adapters (lora.py)
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   live LoRA updates, where the server allows them
    POST /tokenize, /detokenize                   vLLM's shapes
    GET  /health, /metrics                        open (no API key); /metrics is the gRPC server's registry
    GET  /get_load, /load, /get_server_info, /kv_event_sources, POST /v1/{chat/,}completions/render
                                                  what routers ask (router_api.py)
    GET  /openapi.json, /docs                     the schema of all this and Swagger UI (docs.py), open
    GET  /ui                                      the playground (playground.html; off with `ui=False`), open

Every error, including unknown routes (404), a known route asked with another method (405, with
the `Allow` header naming the methods it takes) and a bug in a handler (500), answers
`{"error": {"message", "type", "param", "code"}}`. The Gate middleware (middleware.py) wraps it.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxinfer.tokenizer import Tokenizer
from serving.metrics import ServerMetrics
from serving.openai import handlers
from serving.openai.docs import Docs
from serving.openai.errors import APIError, bad_request, not_found_route
from serving.openai.handlers import ApiContext, parse
from serving.openai.lora import LoraEndpoints, adapter_cards
from serving.openai.messages import render_messages, template_tools
from serving.openai.protocol import DetokenizeRequest, TokenizeRequest
from serving.openai.router_api import RouterEndpoints

logger = logging.getLogger(__name__)

PLAYGROUND = Path(__file__).with_name("playground.html")


class _Endpoints:
    def __init__(self, ctx: ApiContext, metrics: ServerMetrics | None):
        self.ctx, self.metrics = ctx, metrics

    def _model_card(self) -> dict:
        return {
            "id": self.ctx.model_name,
            "object": "model",
            "created": self.ctx.created,
            "owned_by": "jaxinfer",
            "max_model_len": self.ctx.limits.max_model_len,
        }

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card(), *adapter_cards(self.ctx)]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if self.ctx.check_model(name) is not None:
            return JSONResponse(next(c for c in adapter_cards(self.ctx) if c["id"] == name))
        return JSONResponse(self._model_card())

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})  # while draining the middleware answers 503

    async def prometheus(self, request: Request) -> Response:
        if self.metrics is None:
            raise not_found_route(request.url.path)
        body, content_type = self.metrics.exposition()
        return Response(body, media_type=content_type)

    async def _tokenizer_request[T: (TokenizeRequest, DetokenizeRequest)](
        self, request: Request, model_cls: type[T]
    ) -> tuple[T, ApiContext, Tokenizer]:
        """The parsed body of a /tokenize or /detokenize call, for a model with a tokenizer (and it)."""
        req = await parse(request, model_cls)
        self.ctx.check_model(req.model)
        if (tokenizer := self.ctx.tokenizer) is None:
            raise bad_request(None, "this model has no tokenizer")
        return req, self.ctx, tokenizer

    async def tokenize(self, request: Request) -> Response:
        req, ctx, tokenizer = await self._tokenizer_request(request, TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("prompt", "prompt: send exactly one of prompt and messages")
        if req.messages is not None:
            # the chat template writes its own special tokens, exactly as for a chat completion
            ids = await ctx.in_worker(
                render_messages,
                req.messages,
                tokenizer,
                req.add_generation_prompt,
                template_tools(req.tools),
                req.chat_template_kwargs,
            )
        else:
            ids = await ctx.in_worker(tokenizer.encode, req.prompt, req.add_special_tokens)
        return JSONResponse({"count": len(ids), "max_model_len": ctx.limits.max_model_len, "tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        req, ctx, tokenizer = await self._tokenizer_request(request, DetokenizeRequest)
        vocab = ctx.limits.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request("tokens", f"tokens: ids out of range [0, {vocab}): {bad[:5]}")
        text = await ctx.in_worker(tokenizer.decode, req.tokens, True)
        return JSONResponse({"prompt": text})


def build_app(
    ctx: ApiContext,
    metrics: ServerMetrics | None = None,
    api_keys: bool = False,
    ui: bool = True,
    kv_events: Any = None,
) -> Starlette:
    """`api_keys`: the Gate requires them (the schema then says so). `ui`: serve the playground.
    `kv_events`: the KV events publisher whose endpoints /kv_event_sources names."""
    ep, docs = _Endpoints(ctx, metrics), Docs(ctx.model_name, api_keys, ctx.lora_updates)
    routes = [
        Route("/v1/completions", functools.partial(handlers.completions, ctx), methods=["POST"]),
        Route("/v1/chat/completions", functools.partial(handlers.chat_completions, ctx), methods=["POST"]),
        Route("/v1/models", ep.models, methods=["GET"]),
        Route("/v1/models/{model:path}", ep.model, methods=["GET"]),
        Route("/tokenize", ep.tokenize, methods=["POST"]),
        Route("/detokenize", ep.detokenize, methods=["POST"]),
        Route("/health", ep.health, methods=["GET"]),
        Route("/metrics", ep.prometheus, methods=["GET"]),
        Route("/openapi.json", docs.schema, methods=["GET"]),
        Route("/docs", docs.page, methods=["GET"]),
        Route("/docs/{asset}", docs.asset, methods=["GET"]),
        *RouterEndpoints(ctx, kv_events).routes(),
    ]
    if ui:
        routes.append(Route("/ui", _playground(), methods=["GET"]))
    if ctx.lora_updates:
        lora = LoraEndpoints(ctx)
        routes.append(Route("/v1/load_lora_adapter", lora.load, methods=["POST"]))
        routes.append(Route("/v1/unload_lora_adapter", lora.unload, methods=["POST"]))
    return Starlette(
        routes=routes,
        # Starlette types every handler as taking an Exception; each is called with its key's class.
        exception_handlers={
            APIError: _api_error,  # type: ignore[dict-item]
            HTTPException: _http_error,  # type: ignore[dict-item]
            ClientDisconnect: _client_gone,  # type: ignore[dict-item]
            Exception: _internal,
        },
    )


def _playground():
    """The playground page, read once (a static file of the package: no build step, nothing fetched)."""
    page = PLAYGROUND.read_bytes()

    async def serve(request: Request) -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-store"})

    return serve


async def _api_error(request: Request, exc: APIError) -> Response:
    return exc.response()


async def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404:
        return not_found_route(request.url.path).response()
    # 405 carries `Allow` (the route's methods): kept, as HTTP requires
    return APIError(
        exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", headers=exc.headers
    ).response()


async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
    logger.info("%s: the client went away; its requests were aborted", request.url.path)
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


async def _internal(request: Request, exc: Exception) -> Response:
    logger.error("%s failed", request.url.path, exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error").response()
