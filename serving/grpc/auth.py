"""Bearer-token authentication: a grpc.aio server interceptor.

Every call must carry the metadata `authorization: Bearer <token>`; the comparison is
constant-time (hmac.compare_digest) so response timing does not reveal a token's prefix. The
standard health service stays open so load balancers and orchestrators can probe without
the secret. A refused call ends with UNAUTHENTICATED before its handler runs.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"


def read_token(token: str | None = None, token_file: str | None = None) -> str | None:
    """The token from a value or a file (first line); a file keeps it out of `ps` listings."""
    if token_file:
        with open(token_file, encoding="utf-8") as f:
            token = f.readline().strip()
    if token is not None and not token.strip():
        raise ValueError("the auth token is empty")
    return token


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str, open_prefixes: tuple[str, ...] = (HEALTH_PREFIX,)):
        if not token:
            raise ValueError("the auth token is empty")
        self._expected = f"Bearer {token}".encode()
        self._open_prefixes = open_prefixes

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or details.method.startswith(self._open_prefixes):
            return handler
        given = ""
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                given = value if isinstance(value, str) else value.decode("latin-1")
        if hmac.compare_digest(given.encode("utf-8", "replace"), self._expected):
            return handler
        why = "missing bearer token (metadata 'authorization: Bearer <token>')" if not given else "invalid bearer token"
        return _refusing(handler, why)


def _refusing(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape that ends the call with UNAUTHENTICATED."""

    async def refuse(request_or_iterator: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    kwargs = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **kwargs)
    return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)
