"""Tool calls in a model's output text, in the format its chat template taught it (no JAX).

    parser = tool_call_parser("hermes")          # or parser_for_template(tokenizer.chat_template)
    parsed = parser.parse(output_text)          # ParsedText(content, tool_calls)
    parsed.tool_calls[0].name, json.loads(parsed.tool_calls[0].arguments)

Formats (each a parser, by the names vLLM and SGLang give them):
- `hermes` (Qwen 2.5 / 3, Hermes, many others): `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>` blocks, any number, anywhere after some text;
- `llama3_json` (Llama 3.1 - 3.3): the whole output is `{"name": ..., "parameters": {...}}`,
  several separated by `;`, optionally after `<|python_tag|>`;
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` (or, from v11
  tokenizers, `name[ARGS]{...}` per call). `[TOOL_CALLS]` is a special token, so requests
  parsed this way keep special tokens in their text (`keeps_special_tokens`).
A call that does not parse (invalid JSON, no name, arguments that are not an object) stays in
the content as text: nothing the model wrote is lost. Content is the text outside the calls,
trailing whitespace before the first call dropped; without calls it is the text unchanged.
Streaming needs `find` (where the calls start), `safe_length` (how much text before that can be
shown without risking half a marker) and `closed_end` (how far the calls are complete).
"""

from __future__ import annotations

import abc
import dataclasses
import json
import re


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text


@dataclasses.dataclass(frozen=True)
class ParsedText:
    content: str | None  # the text outside the calls; None when there is none
    tool_calls: tuple[ToolCall, ...]


def partial_marker_start(text: str, marker: str) -> int:
    """Where an end of `text` that could be the start of `marker` begins (len(text): none); a
    stream holds that end back until the next text says whether the marker follows."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return len(text) - n
    return len(text)


def _call(name: object, arguments: object) -> ToolCall | None:
    """A ToolCall from a decoded name and arguments (an object, or an object as JSON text)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _from_object(obj: object) -> ToolCall | None:
    """{"name": ..., "arguments": {...}} ("parameters" in Llama 3's format) as a ToolCall."""
    if not isinstance(obj, dict):
        return None
    return _call(obj.get("name"), obj["arguments"] if "arguments" in obj else obj.get("parameters"))


class ToolCallParser(abc.ABC):
    """One output format. Subclasses set `name` and `start` and implement `_calls`."""

    name = ""
    start = ""  # the marker that opens the calls
    keeps_special_tokens = False

    def find(self, text: str) -> int:
        """Where the calls start in `text`, or -1."""
        return text.find(self.start)

    def safe_length(self, text: str) -> int:
        """How much of `text` (with no call in it yet) is content whatever follows: all of it
        but an end that could begin the marker, and trailing whitespace."""
        return len(text[: partial_marker_start(text, self.start)].rstrip())

    def closed_end(self, text: str) -> int:
        """The end of the last call that can no longer change (0: none before the output ends)."""
        return 0

    def parse(self, text: str) -> ParsedText:
        start = self.find(text)
        if start < 0:
            return ParsedText(text or None, ())
        calls, leftover = self._calls(text[start:])
        if not calls:
            return ParsedText(text or None, ())
        content, extra = text[:start].rstrip(), leftover.strip()
        if extra:
            content = f"{content}\n{extra}" if content else extra
        return ParsedText(content or None, tuple(calls))

    @abc.abstractmethod
    def _calls(self, tail: str) -> tuple[list[ToolCall], str]:
        """The calls in the output from the marker on, and the text of it that is no call."""


class HermesParser(ToolCallParser):
    name, start, end = "hermes", "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def closed_end(self, text: str) -> int:
        end = text.rfind(self.end)
        return 0 if end < 0 else end + len(self.end)

    def _calls(self, tail: str) -> tuple[list[ToolCall], str]:
        calls, leftover, pos = [], [], 0
        for block in self._BLOCK.finditer(tail):
            leftover.append(tail[pos : block.start()])
            pos = block.end()
            try:
                call = _from_object(json.loads(block.group(1)))
            except (ValueError, RecursionError):
                call = None
            if call is None:
                leftover.append(block.group(0))
            else:
                calls.append(call)
        leftover.append(tail[pos:])
        return calls, "".join(leftover)


class Llama3JsonParser(ToolCallParser):
    name, start = "llama3_json", "<|python_tag|>"

    def find(self, text: str) -> int:
        tag = text.find(self.start)
        if tag >= 0:
            return tag
        body = text.lstrip()
        return len(text) - len(body) if body.startswith("{") else -1

    def _calls(self, tail: str) -> tuple[list[ToolCall], str]:
        body, calls, decoder = tail.removeprefix(self.start).strip(), [], json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except (ValueError, RecursionError):
                return [], tail
            call = _from_object(obj)
            if call is None:
                return [], tail
            calls.append(call)
            rest = body[pos:].lstrip()
            if rest and rest[0] != ";":
                return [], tail
            pos = len(body) - len(rest.removeprefix(";").lstrip())
        return calls, ""


class MistralParser(ToolCallParser):
    name, start, keeps_special_tokens = "mistral", "[TOOL_CALLS]", True

    def _calls(self, tail: str) -> tuple[list[ToolCall], str]:
        parts = [p.strip() for p in tail.split(self.start)[1:]]
        if len(parts) == 1 and parts[0].startswith("["):
            try:
                objs = json.loads(parts[0])
            except (ValueError, RecursionError):
                return [], tail
            calls = [_from_object(o) for o in objs] if isinstance(objs, list) else [None]
        else:  # v11: [TOOL_CALLS]name[ARGS]{...} per call
            calls = [
                _call(p.split("[ARGS]", 1)[0].strip(), p.split("[ARGS]", 1)[1]) if "[ARGS]" in p else None
                for p in parts
            ]
        found = [c for c in calls if c is not None]
        if not calls or len(found) < len(calls):
            return [], tail
        return found, ""


PARSERS: dict[str, type[ToolCallParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def tool_call_parser(name: str) -> ToolCallParser:
    """The parser named `name` (one of PARSERS); ValueError naming the choices otherwise."""
    if name not in PARSERS:
        raise ValueError(f"tool_call_parser={name!r}: unknown; choose one of {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()


def resolve_parser(setting: str, template: str | None) -> ToolCallParser | None:
    """A server's `--tool-call-parser`: "auto" reads the chat template, "none" reads no calls,
    a name picks that format."""
    if setting == "auto":
        return parser_for_template(template)
    return None if setting == "none" else tool_call_parser(setting)


def parser_for_template(template: str | None) -> ToolCallParser | None:
    """The format a chat template writes tool calls in, from the markers it contains; None when
    it shows none (it may not render tools at all)."""
    if not template:
        return None
    if "<tool_call>" in template:
        return HermesParser()
    if "[TOOL_CALLS]" in template:
        return MistralParser()
    if "<|python_tag|>" in template or ("ipython" in template and '"parameters"' in template):
        return Llama3JsonParser()
    return None
