"""Gate: the ASGI middleware every HTTP request passes before the app sees it.

draining?            -> 503 (health checks too: a load balancer stops sending traffic;
                        /metrics stays up to watch the drain)
API key (not /health, /metrics, /openapi.json, /docs, /ui) -> 401
body over max_body_bytes -> 413, decided on Content-Length or while reading, before any
                        JSON parsing; the body read here is replayed to the app
generation routes    -> Admission.enter(key id): 503 when busy, 429 past the key's requests
                        per minute or concurrency cap (its tokens per minute: in the handler)
the response's status  -> jaxinfer_http_requests_total{route,status}; a log line with the
                        key's id (never the key)
a generation request's end -> Admission.leave (tokens not used are refunded) before the
                        answer's end goes out (the last body message, or a stream's
                        `data: [DONE]`), so a client that has its answer sees the refund;
                        its line in the request log then too, so lines follow the answers'
                        order (record: scope["state"]["record"], filled by handlers)
"""

from __future__ import annotations

import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.metrics import ServerMetrics
from serving.openai import sse
from serving.openai.admission import Admission
from serving.openai.auth import APIKeys
from serving.openai.errors import GRPC_CODES, APIError
from serving.openai.router_api import OPEN_ROUTER_PATHS, RENDER_PATHS
from serving.request_log import RequestLog

logger = logging.getLogger(__name__)

# What routers poll (router_api.py) is open like /health and /metrics.
OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json", "/docs", "/ui"}) | OPEN_ROUTER_PATHS
DOCS_ASSETS = "/docs/"  # Swagger UI's files: open too, as the page that loads them
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
ROUTES = OPEN_PATHS | GENERATION_PATHS | RENDER_PATHS | {"/v1/models", "/tokenize", "/detokenize"}


class Gate:
    def __init__(
        self,
        app: ASGIApp,
        *,
        admission: Admission,
        max_body_bytes: int,
        keys: APIKeys | None = None,
        metrics: ServerMetrics | None = None,
        request_log: RequestLog | None = None,
    ) -> None:
        self.app, self.admission, self.keys, self.metrics = app, admission, keys, metrics
        self.max_body_bytes = max_body_bytes
        self.request_log = request_log or RequestLog()
        self.draining = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        state = scope.setdefault("state", {})
        generation = path in GENERATION_PATHS and scope["method"] == "POST"
        record = state["record"] = self.request_log.start("http", path) if generation else None
        send = self._observed(scope, send)
        try:
            try:
                if self.draining and path != "/metrics":
                    raise APIError(503, "the server is shutting down", code="shutting_down")
                key_id = state["key_id"] = self._authenticate(scope, path)
                if record is not None:
                    record.key_id = key_id
                receive = await self._read_body(scope, receive)
                if generation:
                    state["grant"] = self.admission.enter(key_id)
            except APIError as e:
                if record is not None:
                    record.error = e.message
                return await e.response()(scope, receive, send)
            await self.app(scope, receive, send)
        finally:
            self._end(state)

    def _end(self, state: dict) -> None:
        """The request's end, once (at the answer's end, or when the app returns): its grant
        settled and its request-log line written."""
        if state.get("ended"):
            return
        state["ended"] = True
        record, grant = state.get("record"), state.get("grant")
        if grant is not None:
            self.admission.leave(grant, record.total_tokens if record is not None else None)
        if record is not None:
            self.request_log.finish(record, record.status)

    def _authenticate(self, scope: Scope, path: str) -> str | None:
        authorization = _header(scope, b"authorization")
        if self.keys is None:
            return None
        accepted, key_id = self.keys.check(authorization)
        if accepted or path in OPEN_PATHS or path.startswith(DOCS_ASSETS):
            return key_id if accepted else None
        logger.warning(
            "401 for %s %s: %s", scope["method"], path, f"invalid API key (id {key_id})" if key_id else "no API key"
        )
        raise APIError(
            401,
            "invalid API key" if key_id else "missing API key: send the header 'Authorization: Bearer <key>'",
            code="invalid_api_key",
        )

    async def _read_body(self, scope: Scope, receive: Receive) -> Receive:
        length = _header(scope, b"content-length")
        if length is not None:
            if not length.isdigit():
                raise APIError(400, f"Content-Length={length!r}: not a number")
            if int(length) > self.max_body_bytes:
                raise self._too_large(int(length))
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return receive
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: the app sees it too
                return _replay([message], receive)
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                raise self._too_large(size)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}], receive)

    def _too_large(self, size: int) -> APIError:
        return APIError(
            413,
            f"request body of {size}+ bytes is over this server's limit of "
            f"{self.max_body_bytes} bytes (--max-body-bytes)",
            code="request_too_large",
        )

    def _observed(self, scope: Scope, send: Send) -> Send:
        path = scope["path"]
        route = (
            path
            if path in ROUTES
            else (
                "/v1/models/{model}"
                if path.startswith("/v1/models/")
                else "/docs/{asset}"
                if path.startswith(DOCS_ASSETS)
                else "other"
            )
        )

        async def observed(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                state = scope.get("state", {})
                key_id = state.get("key_id")
                if state.get("record") is not None:
                    state["record"].status = status
                logger.info("%s %s %d key=%s", scope["method"], path, status, key_id or "-")
                if self.metrics is not None:
                    self.metrics.http_requests.labels(route=route, status=str(status)).inc()
                    if status >= 400 and path in GENERATION_PATHS:
                        self.metrics.rejected.labels(code=GRPC_CODES.get(status, f"HTTP_{status}")).inc()
            elif message["type"] == "http.response.body" and (
                not message.get("more_body", False) or message.get("body", b"").endswith(sse.DONE)
            ):
                self._end(scope.get("state", {}))
            await send(message)

        return observed


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive that returns `messages` first, then whatever the connection says next."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed
