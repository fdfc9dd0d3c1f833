"""The request bodies of the OpenAI-compatible API, as pydantic models (types only).

Values are checked where they are used: SamplingParams checks sampling values, inputs.py the
prompts and the fields this server does not support. Fields a client may send that change
nothing here (`store`, `metadata`, `service_tier`, ...) are accepted and ignored, as OpenAI-
compatible servers do; those that would change the answer and are not supported (`suffix`,
the deprecated `functions`) are refused with a 400 naming them. Tools are checked in tools.py. `logit_bias` keys are token ids written as strings
(inputs.py converts them). Structured output comes as OpenAI's
`response_format` (json_object, json_schema) or vLLM's `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar`.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields: ignored (logged by the handler)


class StreamOptions(_Body):
    include_usage: bool = False


class ResponseFormat(_Body):
    type: str
    json_schema: dict[str, Any] | None = None


class SamplingFields(_Body):
    """What completions and chat completions share: OpenAI's fields, then the engine's extras
    (the top-level names vLLM accepts)."""
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: Any = None  # a string or a list of strings (SamplingParams names a bad one)
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # {"50256": -100}: token id -> bias in [-100, 100]
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # engine extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    speculative: bool | None = None  # false: no speculative decoding for this request
    prompt_logprobs: int | None = None  # each prompt token's logprob and top-N (server: --enable-prompt-logprobs)
    guided_json: Any = None  # a JSON schema (object or JSON text)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # Lark (llguidance's dialect)


class CompletionRequest(SamplingFields):
    prompt: Any  # a string, a list of strings, token ids, or a list of token-id lists (inputs.py)
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[Any] | None = None  # an assistant's calls: {"id", "type", "function": {"name", "arguments"}}
    tool_call_id: str | None = None      # a tool message: the call it answers
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Any = None        # [{"type": "function", "function": {"name", "description", "parameters"}}]
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    add_generation_prompt: bool = True  # vLLM's extra: end the prompt with the assistant's turn
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra: more template variables


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or messages rendered with the chat template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # for a prompt (messages: the chat template writes its own)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Any = None  # with messages: rendered by the chat template, as in a chat completion


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
