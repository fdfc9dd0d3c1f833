"""Errors in OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}`.

Every refusal of the HTTP API is an APIError raised where the problem is found (the middleware,
a handler, the request conversion) and turned into one JSON response here. `param` names the
request field at fault, and the message starts with it, as the gRPC server's messages do.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator, Mapping

import pydantic
from starlette.responses import JSONResponse

from serving.engine_loop import RequestRejected, ServerShuttingDown
from serving.errors import RequestError

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}
# The gRPC status a refusal would have had: HTTP refusals count in jaxinfer_rejected_requests_total
# under the same code names as the gRPC server's.
GRPC_CODES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    404: "NOT_FOUND",
    405: "UNIMPLEMENTED",
    413: "RESOURCE_EXHAUSTED",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(param: str | None, message: str) -> APIError:
    """400 whose message starts with the field: `temperature=-1: must be ...`."""
    return APIError(400, message if param is None or message.startswith(param) else f"{param}: {message}", param=param)


def from_validation(error: pydantic.ValidationError) -> APIError:
    """A pydantic error as a 400 naming the first bad field (`messages[0].content`, `temperature`)."""
    first = error.errors(include_url=False)[0]
    param = field_path(first["loc"])
    if first["type"] == "missing":
        return bad_request(param, f"{param}: required")
    value = json.dumps(first.get("input"), default=repr)
    value = value if len(value) <= 60 else value[:57] + "..."
    where = f"{param}={value}" if param else "body"
    return bad_request(param, f"{where}: {first['msg']}")


def field_path(loc: tuple) -> str | None:
    """("messages", 0, "content") -> "messages[0].content"; union branch tags (`str`) are dropped."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _TYPE_TAGS:
            path += f".{part}" if path else part
        else:
            break
    return path or None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}


def from_engine(error: BaseException) -> APIError:
    """What the engine loop handed back instead of outputs."""
    if isinstance(error, RequestRejected):
        return bad_request(None, str(error))
    if isinstance(error, ServerShuttingDown):
        return APIError(503, str(error), code="shutting_down")
    return APIError(500, f"request failed: {type(error).__name__}: {error}", code="internal_error")


def not_found_route(path: str) -> APIError:
    return APIError(404, f"no route {path}", code="not_found")


def unknown_model(requested: str, served: str, adapters: list[str] | None = None) -> APIError:
    also = f" and the LoRA adapters {', '.join(f'`{a}`' for a in adapters)}" if adapters else ""
    return APIError(
        404,
        f"model: the model `{requested}` does not exist; this server serves `{served}`{also}",
        param="model",
        code="model_not_found",
    )


@contextlib.contextmanager
def named_400() -> Iterator[None]:
    """serving.tools' RequestErrors ("tools[1].function.name=...: ...") as 400s naming the field."""
    try:
        yield
    except RequestError as e:
        field = m.group(0) if (m := re.match(r"[\w.\[\]]+", str(e))) else "request"  # they lead with it
        raise bad_request(field, str(e)) from None
