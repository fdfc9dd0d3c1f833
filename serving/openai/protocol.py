"""The request bodies of the OpenAI-compatible API, as pydantic models (types only); the OpenAPI
schema at /openapi.json is generated from these same models (schema.py).

Values are checked where they are used: SamplingParams checks sampling values, inputs.py the
prompts and the fields this server does not support. Fields a client may send that change
nothing here (`store`, `metadata`, `service_tier`, ...) are accepted and ignored, as OpenAI-
compatible servers do; those that would change the answer and are not supported (`suffix`,
the deprecated `functions`) are refused with a 400 naming them. Tools are checked in tools.py.
`logit_bias` keys are token ids written as strings (inputs.py converts them). Structured output
comes as OpenAI's `response_format` (json_object, json_schema) or vLLM's `guided_json` /
`guided_regex` / `guided_choice` / `guided_grammar`.

Every optional field is nullable, as in OpenAI's API reference: an explicit `null` means the
field's default (`"stream": null` streams no more than leaving it out). Fields typed `Any` are
checked by hand (with messages naming the element at fault); their schema says what is accepted.
The ranges in the schema are SamplingParams' own; the server's limits (vocabulary, context, n,
logprobs) may refuse more, with a 400 naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_validator

from jaxinfer.sampling.params import MAX_BIAS, MAX_LOGIT_BIAS, MAX_LOGPROBS

_NULL = {"type": "null"}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_STRINGS = {"type": "array", "items": {"type": "string"}}
_PROMPT = {
    "anyOf": [
        {"type": "string"},
        {**_STRINGS, "minItems": 1},
        _TOKEN_IDS,
        {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
    ],
    "description": "a string, a list of strings, a list of token ids, or a list of token-id lists; "
    "token ids may be written as integral numbers (272.0)",
}
_FUNCTION = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
        "description": {"type": "string"},
        "parameters": {"type": "object", "description": "a JSON schema of the arguments"},
    },
}
_TOOLS = {
    "anyOf": [
        {
            "type": "array",
            "minItems": 1,
            "maxItems": 128,
            "items": {
                "type": "object",
                "required": ["type", "function"],
                "properties": {"type": {"const": "function"}, "function": _FUNCTION},
            },
        },
        _NULL,
    ]
}
_TOOL_CHOICE = {
    "anyOf": [
        {"enum": ["none", "auto", "required"]},
        {
            "type": "object",
            "required": ["type", "function"],
            "properties": {
                "type": {"const": "function"},
                "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
            },
        },
        _NULL,
    ]
}


def _documented(
    low: float | None = None, high: float | None = None, exclusive_low: bool = False, **extra: Any
) -> Any:  # extra: JSON schema keywords; -> pydantic's Field (typed Any for the field's annotation)
    """Field(None) whose schema states what is accepted (SamplingParams' range, `extra` keywords);
    inputs.py and SamplingParams enforce it, naming the field, so pydantic does not."""
    bounds = {
        **({} if low is None else {"exclusiveMinimum" if exclusive_low else "minimum": low}),
        **({} if high is None else {"maximum": high}),
        **extra,
    }
    return Field(None, json_schema_extra=bounds)


def _typed(schema: dict, nullable: bool = True) -> WithJsonSchema:
    """The schema of a field typed Any (read by hand), null allowed unless it is required."""
    return WithJsonSchema({"anyOf": [*schema.get("anyOf", [schema]), _NULL]} if nullable else schema)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields: ignored (logged by the handler)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """An explicit null for a field with a default (stream, echo, ...) is that default."""
        if not isinstance(data, dict):
            return data
        keep = {name for name, f in cls.model_fields.items() if f.is_required() or f.default is None}
        return {
            key: value for key, value in data.items() if value is not None or key in keep or key not in cls.model_fields
        }


class StreamOptions(_Body):
    include_usage: bool | None = False


class ResponseFormat(_Body):
    type: str = Field(json_schema_extra={"enum": ["text", "json_object", "json_schema"]})
    json_schema: dict[str, Any] | None = None  # {"name", "schema", "strict"}: the output's JSON schema


class SamplingFields(_Body):
    """What completions and chat completions share: OpenAI's fields, then the engine's extras
    (the top-level names vLLM accepts)."""

    model: str
    max_tokens: int | None = _documented(0)
    temperature: float | None = _documented(0)
    top_p: float | None = _documented(0, 1, exclusive_low=True)
    n: int | None = _documented(1)
    stop: Annotated[
        Any,
        _typed(
            {"anyOf": [{"type": "string", "minLength": 1}, {**_STRINGS, "items": {"type": "string", "minLength": 1}}]}
        ),
    ] = None
    seed: int | None = None
    presence_penalty: float | None = _documented(-2, 2)
    frequency_penalty: float | None = _documented(-2, 2)
    # {"50256": -100}: token id -> bias
    logit_bias: dict[str, float] | None = _documented(
        maxProperties=MAX_LOGIT_BIAS,
        propertyNames={"pattern": "^[0-9]+$"},
        additionalProperties={"type": "number", "minimum": -MAX_BIAS, "maximum": MAX_BIAS},
    )
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None  # only with stream: true
    response_format: ResponseFormat | None = None
    # engine extras
    top_k: int | None = _documented(-1)
    min_p: float | None = _documented(0, 1)
    repetition_penalty: float | None = _documented(0, exclusive_low=True)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = _documented(items={"type": "integer", "minimum": 0})
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    speculative: bool | None = None  # false: no speculative decoding for this request
    prompt_logprobs: int | None = _documented(0, MAX_LOGPROBS)  # each prompt token's logprob and top-N
    guided_json: Annotated[Any, _typed({"anyOf": [{"type": "object"}, {"type": "string"}]})] = None  # a JSON schema
    guided_regex: str | None = _documented(minLength=1)
    guided_choice: list[str] | None = _documented(minItems=1, items={"type": "string", "minLength": 1})
    guided_grammar: str | None = _documented(minLength=1)  # Lark (llguidance's dialect)
    # Disaggregated prefill/decode (vLLM's field, as vllm-router's P/D mode sends it):
    # {"do_remote_decode": true} computes the prompt for a decode server, whose params the
    # answer's kv_transfer_params carry; {"do_remote_prefill": true, ...} decodes from them.
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: Annotated[Any, WithJsonSchema(_PROMPT)]  # inputs.py reads each shape
    logprobs: int | None = _documented(0, MAX_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None  # refused when not empty
    best_of: int | None = None  # only best_of == n
    use_beam_search: bool | None = False  # vLLM's extra: n beams of one beam search (serving/openai/beam.py)
    length_penalty: float | None = None  # with use_beam_search: scores divide by length ** length_penalty


class ContentPart(_Body):
    type: str = Field(json_schema_extra={"const": "text"})
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    # an assistant's calls: {"id", "type", "function": {"name", "arguments"}}
    tool_calls: list[Any] | None = _documented(items={"type": "object"})
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    max_completion_tokens: int | None = _documented(1)
    logprobs: bool | None = False
    top_logprobs: int | None = _documented(0, MAX_LOGPROBS)  # needs logprobs: true
    tools: Annotated[Any, WithJsonSchema(_TOOLS)] = None
    tool_choice: Annotated[Any, WithJsonSchema(_TOOL_CHOICE)] = None
    parallel_tool_calls: bool | None = None
    functions: Annotated[Any, _typed({"type": "array", "description": "deprecated: refused, use tools"})] = None
    function_call: Annotated[Any, _typed({"description": "deprecated: refused, use tool_choice"})] = None
    add_generation_prompt: bool | None = True  # vLLM's extra: end the prompt with the assistant's turn
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra: more template variables


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or messages rendered with the chat template (exactly one)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = True  # for a prompt (messages: the chat template writes its own)
    add_generation_prompt: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[Any, WithJsonSchema(_TOOLS)] = None  # with messages: rendered by the chat template


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int] = Field(json_schema_extra={"items": {"type": "integer", "minimum": 0}})


class LoadLoraAdapterRequest(_Body):
    """vLLM's /v1/load_lora_adapter: an adapter's name and its PEFT directory on the server."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(_Body):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's, accepted and unused: the name is the adapter
