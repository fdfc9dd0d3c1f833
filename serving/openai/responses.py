"""The response bodies of the OpenAI-compatible API, as pydantic models: what /openapi.json says
each route answers (schema.py). outputs.py and app.py build the bodies as dicts; the served
schema tests (tests/serving/openai) hold those dicts to these models.

Fields the server adds beside OpenAI's (vLLM's `prompt_logprobs`, `reasoning_content`) are
declared; the models allow more fields, as OpenAI's objects grow.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, RootModel


class _Object(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorBody(_Object):
    message: str
    type: str  # invalid_request_error, rate_limit_error, server_error
    param: str | None  # the request field at fault
    code: str | None


class ErrorResponse(_Object):
    error: ErrorBody


class Usage(_Object):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None  # {"cached_tokens": N}


class CompletionChoice(_Object):
    index: int
    text: str
    logprobs: dict[str, Any] | None  # {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    finish_reason: str | None  # stop, length, abort
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # requests with prompt_logprobs


class _Response(_Object):
    id: str
    created: int
    model: str


class CompletionResponse(_Response):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage


class ChatMessageOut(_Object):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None  # a server with --reasoning-parser
    tool_calls: list[dict[str, Any]] | None = None  # {"id", "type": "function", "function": {"name", "arguments"}}


class ChatChoice(_Object):
    index: int
    message: ChatMessageOut
    finish_reason: str | None  # stop, length, tool_calls, abort
    logprobs: dict[str, Any] | None  # {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class ModelCard(_Object):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    root: str | None = None  # a LoRA adapter's: its directory on the server
    parent: str | None = None  # a LoRA adapter's: the base model it adapts


class ModelList(_Object):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Object):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(_Object):
    prompt: str


class Health(_Object):
    status: Literal["ok"]


# --- what routers read (router_api.py) -------------------------------------------------------------
class Load(_Object):
    load: int  # requests in the engine (running or waiting)
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage: float


class ServerLoad(_Object):
    server_load: int


class ServerInfo(_Object):
    model_id: str
    model_path: str
    kv_block_size: int  # tokens per KV page: what a prefix-aware router hashes prompts by
    max_model_len: int
    data_parallel_size: int
    kv_events: bool


class KVEventSource(_Object):
    enable_kv_cache_events: bool
    publisher: Literal["zmq"]
    endpoint: str
    replay_endpoint: str | None
    topic: str
    buffer_steps: int
    hwm: int
    encoding: Literal["msgpack"]
    schema_version: int


class KVEventSources(RootModel[dict[str, KVEventSource]]):
    """By data-parallel rank ("0", "1", ...); empty when the server publishes no KV events."""


class RenderedPrompt(_Object):
    token_ids: list[int]


class RenderedPrompts(RootModel[list[RenderedPrompt]]):
    """One per prompt of the request, in order."""
