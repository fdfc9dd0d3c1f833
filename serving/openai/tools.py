"""Tool calls and reasoning in OpenAI's shapes (serving/tools.py reads the request and the text;
jaxinfer.tokenizer.reasoning splits the thinking off): a whole choice's message with
`reasoning_content`, `content` and `tool_calls` and its finish_reason, and a streamed choice's
deltas.

A choice with calls ends with finish_reason "tool_calls" (a named function keeps "stop", as
OpenAI's does). Streamed, reasoning goes out as `delta.reasoning_content` as it comes; content
as soon as it cannot be the start of a call; each call whole in one delta once it can no longer
change; a named function's arguments as they are generated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxinfer.tokenizer.reasoning import ReasoningParser
from jaxinfer.tokenizer.tool_calls import ToolCall
from serving.tools import ToolRequest, new_call_id


def message(
    request: ToolRequest | None, text: str, finish_reason: str | None, reasoning: ReasoningParser | None = None
) -> tuple[dict, str | None]:
    """A whole choice's message and finish_reason (`reasoning`: the server's reasoning parser)."""
    thought, text = reasoning.split(text) if reasoning is not None else (None, text)
    fields: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning is not None:
        fields["reasoning_content"] = thought
    if request is None:
        return fields, finish_reason
    parsed = request.parse(text)
    fields["content"] = parsed.content
    if parsed.tool_calls:
        fields["tool_calls"] = [_openai_call(call) for call in parsed.tool_calls]
    return fields, finish_reason_of(request, finish_reason, bool(parsed.tool_calls))


def finish_reason_of(request: ToolRequest | None, reason: str | None, made_calls: bool) -> str | None:
    if request is None:
        return reason
    return "tool_calls" if made_calls and reason == "stop" and request.mode != "named" else reason


class ChoiceStream:
    """One streamed chat choice read for reasoning and/or tool calls: each text delta ->
    (reasoning, content, tool_call deltas)."""

    def __init__(self, tools: ToolRequest | None, reasoning: ReasoningParser | None):
        self.tools = None if tools is None else ToolStream(tools)
        self.reasoning = None if reasoning is None else reasoning.stream()

    @property
    def made_calls(self) -> bool:
        return self.tools is not None and self.tools.num_calls > 0

    def feed(self, delta: str, final: bool) -> tuple[str, str, list[dict]]:
        thought = ""
        if self.reasoning is not None:
            thought, delta = self.reasoning.feed(delta)
            if final:
                more_thought, more = self.reasoning.finish()
                thought, delta = thought + more_thought, delta + more
        if self.tools is None:
            return thought, delta, []
        return thought, *self.tools.feed(delta, final)


def _openai_call(call: ToolCall) -> dict:
    return {"id": new_call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


class ToolStream:
    """One streamed choice: each text delta -> (content to show, tool_call deltas). Content is
    shown as soon as it cannot be the start of a call; calls once they can no longer change."""

    def __init__(self, request: ToolRequest):
        self.request, self.text, self._shown, self.num_calls = request, "", 0, 0
        self._start = -1  # where the calls start, once seen (it does not move as text is added)
        self._closed = 0  # the end of the calls parsed so far

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict]]:
        self.text += delta
        if self.request.mode == "named":
            return "", self._arguments(delta)
        parser = self.request.parser
        if parser is None:  # tool_choice "none": its choices are not read for calls
            return self._show(self.text), []
        if final:
            parsed = parser.parse(self.text)
            return self._show(parsed.content or ""), self._calls(parsed.tool_calls)
        if self._start < 0:
            self._start = parser.find(self.text)
            if self._start < 0:
                return self._show(self.text[: parser.safe_length(self.text)]), []
        calls: Sequence[ToolCall] = ()
        end = parser.closed_end(self.text)
        if end > max(self._start, self._closed):  # a call closed since the last delta: parse up to it
            self._closed, calls = end, parser.parse(self.text[:end]).tool_calls
        return self._show(self.text[: self._start].rstrip()), self._calls(calls)

    def _show(self, content: str) -> str:
        new = content[self._shown :]
        self._shown = max(self._shown, len(content))
        return new

    def _calls(self, calls: Sequence[ToolCall]) -> list[dict]:
        new = [{"index": self.num_calls + k, **_openai_call(call)} for k, call in enumerate(calls[self.num_calls :])]
        self.num_calls += len(new)
        return new

    def _arguments(self, delta: str) -> list[dict]:
        if self.num_calls:
            return [{"index": 0, "function": {"arguments": delta}}] if delta else []
        self.num_calls = 1
        call = _openai_call(ToolCall(self.request.name or "", delta))  # named: the function's
        return [{"index": 0, **call}]
