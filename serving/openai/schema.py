"""The HTTP API's OpenAPI 3.1 schema, served at /openapi.json (and shown by /docs).

    OPERATIONS: route -> request model (protocol.py), response model (responses.py), the error
                statuses it can answer -> openapi_schema(): paths + components/schemas, the JSON
                schemas pydantic writes for those same models
    LORA_OPERATIONS: the routes of live LoRA updates, in the schema of a server that serves
                them (--allow-runtime-lora-updating)

The request bodies are the models handlers.parse validates, so the schema cannot drift from
what the server reads; the one fact a model cannot know, the served model's name, is written in
as the only value of each `model` (any other answers 404). Every error answers ErrorResponse
(OpenAI's error JSON). With API keys,
the routes that need one carry the bearer security scheme (/health, /metrics and these
documents stay open, as middleware.OPEN_PATHS says).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from jaxinfer import __version__
from serving.openai import protocol, responses

_REF = "#/components/schemas/{model}"
_STATUS_TEXT = {
    400: "a bad request: the message and `param` name the field",
    401: "a missing or unknown API key",
    404: "an unknown model, LoRA adapter or route",
    413: "a body over --max-body-bytes",
    429: "past a per-key rate limit (Retry-After when waiting helps)",
    500: "a server error",
    503: "busy (Retry-After: 1) or shutting down",
}
_BODY_ERRORS = (400, 413)  # a POST's body is read: too large, or not what the model says
_ALWAYS = (500, 503)
# One server-sent event of a streamed answer (OpenAPI 3.1: `schema` describes each event).
_EVENT = {
    "type": "object",
    "required": ["data"],
    "description": 'with `"stream": true`: one event per chunk',
    "properties": {
        "data": {
            "type": "string",
            "description": "a chunk (JSON: the response's shape, whose "
            "choices carry deltas; an error as ErrorResponse), then `[DONE]` last",
        }
    },
}


@dataclasses.dataclass(frozen=True)
class Operation:
    method: str
    path: str
    summary: str
    response: type[BaseModel] | str  # a model, or a media type answered as text
    request: type[BaseModel] | None = None
    errors: tuple[int, ...] = ()
    streams: bool = False  # `"stream": true` answers server-sent events
    open: bool = False  # no API key needed

    @property
    def statuses(self) -> tuple[int, ...]:
        keyed = () if self.open else (401,)
        return tuple(sorted({*self.errors, *keyed, *_ALWAYS, *(_BODY_ERRORS if self.request else ())}))


OPERATIONS = (
    Operation(
        "post",
        "/v1/completions",
        "Complete prompts (text or token ids)",
        responses.CompletionResponse,
        protocol.CompletionRequest,
        (404, 429),
        streams=True,
    ),
    Operation(
        "post",
        "/v1/chat/completions",
        "Answer a chat (the model's chat template)",
        responses.ChatCompletionResponse,
        protocol.ChatCompletionRequest,
        (404, 429),
        streams=True,
    ),
    Operation("get", "/v1/models", "The served model, then its LoRA adapters", responses.ModelList),
    Operation("get", "/v1/models/{model}", "One model or LoRA adapter by name", responses.ModelCard, errors=(404,)),
    Operation(
        "post",
        "/tokenize",
        "Text or chat messages -> token ids",
        responses.TokenizeResponse,
        protocol.TokenizeRequest,
        (404,),
    ),
    Operation(
        "post", "/detokenize", "Token ids -> text", responses.DetokenizeResponse, protocol.DetokenizeRequest, (404,)
    ),
    Operation("get", "/health", "200 while serving, 503 while shutting down", responses.Health, open=True),
    Operation(
        "get", "/metrics", "Prometheus metrics (404 when the server keeps none)", "text/plain", errors=(404,), open=True
    ),
    # What routers read (router_api.py).
    Operation("get", "/get_load", "The requests in the engine (a router's load poll)", responses.Load, open=True),
    Operation("get", "/load", "The requests in the engine, under vLLM's name", responses.ServerLoad, open=True),
    Operation("get", "/get_server_info", "The model and its KV page size", responses.ServerInfo, open=True),
    Operation(
        "get", "/kv_event_sources", "Where KV events are published, by rank", responses.KVEventSources, open=True
    ),
    Operation(
        "post",
        "/v1/completions/render",
        "The prompts' token ids, as /v1/completions would compute them",
        responses.RenderedPrompts,
        protocol.CompletionRequest,
        (404,),
    ),
    Operation(
        "post",
        "/v1/chat/completions/render",
        "The chat's prompt token ids, as /v1/chat/completions would compute them",
        responses.RenderedPrompt,
        protocol.ChatCompletionRequest,
        (404,),
    ),
)
LORA_OPERATIONS = (
    Operation(
        "post",
        "/v1/load_lora_adapter",
        "Load a LoRA adapter (a PEFT directory on the server) under a name requests give as their model",
        "text/plain",
        protocol.LoadLoraAdapterRequest,
    ),
    Operation(
        "post",
        "/v1/unload_lora_adapter",
        "Unload a LoRA adapter no request uses (400 while one does)",
        "text/plain",
        protocol.UnloadLoraAdapterRequest,
        (404,),
    ),
)


def openapi_schema(model_name: str, api_keys: bool = False, lora_updates: bool = False) -> dict:
    """The schema of this API serving `model_name` (`api_keys`: the server requires them;
    `lora_updates`: it serves LORA_OPERATIONS)."""
    operations = OPERATIONS + (LORA_OPERATIONS if lora_updates else ())
    models: list[tuple[type[BaseModel], JsonSchemaMode]] = [
        (op.request, "validation") for op in operations if op.request is not None
    ]
    served = [op.response for op in operations if not isinstance(op.response, str)] + [responses.ErrorResponse]
    models += [(m, "serialization") for m in served]
    refs, defs = models_json_schema(models, ref_template=_REF)
    paths: dict[str, dict] = {}
    for op in operations:
        paths.setdefault(op.path, {})[op.method] = _operation(op, refs, api_keys, model_name)
    components: dict = {"schemas": _naming_the_model(defs.get("$defs", {}), model_name)}
    if api_keys:
        components["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer", "description": "Authorization: Bearer <API key>"}
        }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "jaxinfer: OpenAI-compatible API",
            "version": __version__,
            "description": "The OpenAI-compatible HTTP API of `jaxinfer serve --http-port`: OpenAI's "
            "fields, then vLLM's extras (top_k, guided_json, ...).",
        },
        "paths": paths,
        "components": components,
    }


def _naming_the_model(schemas: dict, model_name: str) -> dict:
    """Each request's `model`: the served model's name (or null where the field is optional)."""
    named = {"type": "string", "enum": [model_name]}
    for schema in schemas.values():
        field = schema.get("properties", {}).get("model")
        if field is not None and "anyOf" in field:
            field["anyOf"] = [named if branch.get("type") == "string" else branch for branch in field["anyOf"]]
        elif field is not None:
            field.update(named)
    return schemas


def _operation(op: Operation, refs: dict, api_keys: bool, model_name: str) -> dict:
    ok: dict[str, Any]
    if isinstance(op.response, str):
        ok = {op.response: {"schema": {"type": "string"}}}
    else:
        ok = {"application/json": {"schema": refs[(op.response, "serialization")]}}
        if op.streams:
            ok["text/event-stream"] = {"schema": _EVENT}
    error = {"application/json": {"schema": refs[(responses.ErrorResponse, "serialization")]}}
    answers = {"200": {"description": "OK", "content": ok}}
    answers.update({str(code): {"description": _STATUS_TEXT[code], "content": error} for code in op.statuses})
    spec: dict[str, Any] = {
        "summary": op.summary,
        "operationId": op.method + re.sub(r"\W+", "_", op.path).rstrip("_"),
        "responses": answers,
    }
    if op.request is not None:
        spec["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": refs[(op.request, "validation")]}},
        }
    if "{model}" in op.path:
        spec["parameters"] = [
            {"name": "model", "in": "path", "required": True, "schema": {"type": "string", "enum": [model_name]}}
        ]
    if api_keys and not op.open:
        spec["security"] = [{"bearer": []}]
    return spec
