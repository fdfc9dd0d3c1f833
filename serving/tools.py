"""Tool calling, for both transports: a request's tools and tool_choice checked and turned into
what the chat template and the sampler get, and how its output is read back.

    tool_choice  prompt                 output                                   read as
    "none"       tools in the template  free                                     content only
    "auto"       tools in the template  free                                     the server's format
    "required"   tools in the template  a JSON list of {name, parameters} (structured output)
    a function   tools in the template  that function's parameters (structured output)
"auto" (the default when tools are given) needs a format: the server's `--tool-call-parser`, or
the one the model's chat template shows (jaxinfer.tokenizer.tool_calls.parser_for_template).
Tools are OpenAI's JSON shapes on both transports. Errors are RequestErrors whose message starts
with the field (`tools[1].function.name=...`), which each transport names its own way.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import uuid
from typing import Any

from jaxinfer.sampling import StructuredOutput
from jaxinfer.tokenizer import Tokenizer
from jaxinfer.tokenizer.reasoning import ReasoningParser
from jaxinfer.tokenizer.reasoning import reasoning_parser as named_reasoning_parser
from jaxinfer.tokenizer.tool_calls import ParsedText, ToolCall, ToolCallParser, resolve_parser
from serving.errors import RequestError

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_TOOLS = 128  # OpenAI's limit; "required" compiles an anyOf over all of them (~0.4 ms a tool here)
_CHOICES = '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class RequiredCallsParser(ToolCallParser):
    """tool_choice "required": the whole output is a JSON list of {"name", "parameters"}."""

    name = "required"

    def find(self, text: str) -> int:
        return 0

    def _calls(self, tail: str) -> tuple[list[ToolCall], str]:
        try:  # the grammar made it so, unless the output was cut short
            calls = [ToolCall(o["name"], json.dumps(o["parameters"], ensure_ascii=False)) for o in json.loads(tail)]
        except (ValueError, KeyError, TypeError):
            return [], tail
        return calls, ""


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    tools: list[dict]  # as the chat template gets them
    mode: str  # none | auto | required | named
    parser: ToolCallParser | None  # how auto and required outputs are read
    name: str | None = None  # named: the function
    structured_output: StructuredOutput | None = None  # required and named

    def parse(self, text: str) -> ParsedText:
        if self.mode == "named" and self.name is not None:
            return ParsedText(None, (ToolCall(self.name, text),))
        if self.parser is None:  # mode "none": content only (its outputs are not read for calls)
            return ParsedText(text, ())
        return self.parser.parse(text)


class ChatReplies:
    """A chat request's samples' text so far, read as each finishes: the reasoning split off (a
    server's reasoning parser), then the calls out of the rest (a tool choice other than none)."""

    def __init__(self, tools: ToolRequest | None, reasoning: ReasoningParser | None = None):
        self.tools, self.reasoning = tools, reasoning
        self._texts: dict[int, str] = {}

    def add(self, index: int, text: str, finished: bool) -> tuple[str | None, ParsedText] | None:
        """Sample `index`'s new text; once it has finished, (its reasoning, its content and calls)."""
        self._texts[index] = self._texts.get(index, "") + text
        if not finished:
            return None
        thought, rest = (
            (None, self._texts.pop(index)) if self.reasoning is None else self.reasoning.split(self._texts.pop(index))
        )
        return thought, (ParsedText(rest, ()) if self.tools is None else self.tools.parse(rest))


def output_readers(
    tokenizer: Tokenizer | None, tool_call_parser: str, reasoning_parser: str | None
) -> tuple[ToolCallParser | None, ReasoningParser | None]:
    """A server's (tool-call format, reasoning parser), from `--tool-call-parser` (auto: the one
    the chat template shows) and `--reasoning-parser`; both transports read chat outputs with them."""
    tool_parser = resolve_parser(tool_call_parser, getattr(tokenizer, "chat_template", None))
    reasoning = None if reasoning_parser is None else named_reasoning_parser(reasoning_parser)
    logger.info(
        "chat outputs read for tool calls as %s, for reasoning as %s",
        tool_parser.name if tool_parser else "none",
        reasoning.name if reasoning else "none",
    )
    return tool_parser, reasoning


def reasoning_for(
    reasoning: ReasoningParser | None, structured_output: StructuredOutput | None, engine_gated: bool
) -> ReasoningParser | None:
    """How a request's output is read for reasoning. Where the engine gates grammars behind the
    reasoning (EngineConfig.reasoning_parser, set by `serve --reasoning-parser`), as any output;
    otherwise a constrained one only where it writes `<think>` (a grammar that constrains the
    whole output leaves no room for implied reasoning)."""
    if reasoning is None or structured_output is None or engine_gated:
        return reasoning
    return reasoning.explicit()


def tool_request(
    tools: object, tool_choice: object, parallel: bool | None, parser: ToolCallParser | None
) -> ToolRequest | None:
    """The request's tools and tool_choice (JSON values) checked (RequestError naming the field);
    None without tools."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise RequestError(f"tool_choice={_short(tool_choice)}: needs tools")
        return None
    checked = checked_tools(tools)
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in checked}
    mode, name = _checked_choice(tool_choice, schemas)
    if mode == "auto" and parser is None:
        raise RequestError(
            'tool_choice="auto": this server reads no tool-call format for this model (its chat '
            "template shows none); start it with --tool-call-parser, or ask for tool_choice "
            '"required" or a named function'
        )
    if mode == "required":
        item = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"type": "string", "enum": [n]}, "parameters": s},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for n, s in schemas.items()
            ]
        }
        schema = {"type": "array", "items": item, "minItems": 1, **({} if parallel is not False else {"maxItems": 1})}
        return ToolRequest(checked, mode, RequiredCallsParser(), structured_output=StructuredOutput(json=schema))
    if mode == "named" and name is not None:
        return ToolRequest(checked, mode, None, name, StructuredOutput(json=schemas[name]))
    return ToolRequest(checked, mode, parser)


def checked_tools(tools: object) -> list[dict]:
    """OpenAI's tools list, each a function with a unique name and an object schema."""
    if not isinstance(tools, list) or not tools:
        raise RequestError('tools: must be a non-empty list of {"type": "function", "function": {...}}')
    if len(tools) > MAX_TOOLS:
        raise RequestError(f"tools: {len(tools)} tools; at most {MAX_TOOLS}")
    names = set()
    for i, tool in enumerate(tools):
        field = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise RequestError(f'{field}.type={_short(kind)}: only "function" tools are supported')
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise RequestError(f"{field}.function: required, an object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise RequestError(f"{field}.function.name={_short(name)}: must be 1-64 letters, digits, '_', '.' or '-'")
        if name in names:
            raise RequestError(f"{field}.function.name={name!r}: named twice")
        names.add(name)
        if not isinstance(fn.get("parameters", {}), dict):
            raise RequestError(f"{field}.function.parameters: must be a JSON schema object")
    return tools


def _checked_choice(choice: object, schemas: dict[str, Any]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if isinstance(choice, str) and choice in ("none", "auto", "required"):
        return choice, None
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(f"tool_choice={_short(choice)}: must be {_CHOICES}")
    if fn["name"] not in schemas:
        raise RequestError(f"tool_choice.function.name={fn['name']!r}: not among the tools ({', '.join(schemas)})")
    return "named", fn["name"]


def template_call(call: object, field: str) -> dict[str, Any]:
    """An assistant message's tool call (a JSON value) as templates read it: arguments decoded (they
    write them with `tojson`). RequestError naming the field when it is malformed."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(call, dict) or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(f"{field}.function: must be an object with a name")
    arguments = fn.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except (ValueError, RecursionError):
        arguments = None
    if not isinstance(arguments, dict):
        raise RequestError(f"{field}.function.arguments: must be a JSON object (as text)")
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": arguments}}


def sampling_updates(
    tools: ToolRequest,
    structured_output: StructuredOutput | None,
    skip_special_tokens_given: bool,
    structured_field: str,
) -> dict[str, Any]:
    """The SamplingParams fields the tool choice sets: "required" and named choices the structured
    output that makes the calls (not beside the request's own); a format whose marker is a special
    token keeps special tokens in the text unless the request said otherwise."""
    updates: dict[str, Any] = {}
    if tools.structured_output is not None:
        if structured_output is not None:
            raise RequestError(
                f"{structured_field}: not together with tool_choice={tools.mode!r}, which constrains the output itself"
            )
        updates["structured_output"] = tools.structured_output
    if tools.parser is not None and tools.parser.keeps_special_tokens and not skip_special_tokens_given:
        updates["skip_special_tokens"] = False
    return updates


def _short(value: object) -> str:
    return json.dumps(value, default=repr)[:80]
