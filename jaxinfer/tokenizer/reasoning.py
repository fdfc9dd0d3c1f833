"""A reasoning model's thinking split from its answer (no JAX): `<think>...</think>` then the
answer, as Qwen3, DeepSeek-R1 and their distills write it.

    parser = reasoning_parser("qwen3")
    reasoning, content = parser.split(text)       # reasoning None when the output has none
    stream = parser.stream(); stream.feed(delta) -> (reasoning delta, content delta); stream.finish()

Formats (by the names vLLM and SGLang give them):
- `qwen3`: reasoning only where the output opens with `<think>` (thinking can be switched off by
  the chat template, `enable_thinking=False`, and then there is none);
- `deepseek_r1`: the output starts inside the reasoning whether or not it writes `<think>`
  (newer templates open it in the prompt), up to `</think>`.
An output cut short inside its reasoning is all reasoning. The whitespace between the markers
and the text is dropped, as is the reasoning's trailing whitespace. `split` is the stream fed
the whole text at once, so a streamed choice adds up to the whole one.
"""

from __future__ import annotations

from jaxinfer.tokenizer.tool_calls import partial_marker_start

START, END = "<think>", "</think>"


class ReasoningStream:
    """One output, delta by delta. States: deciding whether it opens with reasoning, in the
    reasoning, past it (leading whitespace dropped), in the content."""

    def __init__(self, implicit: bool):
        self._state = "reasoning" if implicit else "start"
        self._implicit, self._buf = implicit, ""
        self._shown_any = False  # reasoning text shown already (so its leading whitespace is gone)

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        reasoning = content = ""
        while True:
            state = self._state
            if state == "start":
                if not self._decide():
                    break
            elif state == "reasoning":
                shown, done = self._reasoning()
                reasoning += shown
                if not done:
                    break
            elif state == "after":
                self._buf = self._buf.lstrip()
                if not self._buf:
                    break
                self._state = "content"
            else:
                content, self._buf = content + self._buf, ""
                break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held back once the output has ended."""
        if self._state == "start":  # a prefix of <think> and no more: content
            self._state = "content"
        rest, self._buf = self._buf, ""
        if self._state == "reasoning":
            return (rest.rstrip() if self._shown_any else rest.strip()), ""
        return "", ("" if self._state == "after" else rest)

    def _decide(self) -> bool:
        body = self._buf.lstrip()
        if body.startswith(START):
            self._buf, self._state = body[len(START) :], "reasoning"
            return True
        if START.startswith(body):
            return False  # empty, or a prefix of <think>: wait for more
        self._state = "content"
        return True

    def _reasoning(self) -> tuple[str, bool]:
        """(reasoning to show, whether the reasoning ended)."""
        if not self._shown_any:
            stripped = self._buf.lstrip()
            if self._implicit and stripped.startswith(START):  # deepseek_r1 writing <think> itself
                stripped = stripped[len(START) :].lstrip()
            elif self._implicit and START.startswith(stripped) and stripped:
                return "", False  # maybe <think>: wait
            self._buf = stripped
        end = self._buf.find(END)
        if end >= 0:
            shown, self._buf, self._state = self._buf[:end].rstrip(), self._buf[end + len(END) :], "after"
            self._shown_any = self._shown_any or bool(shown)
            return shown, True
        # an end that could begin </think> waits, and so does trailing whitespace (it may precede it)
        shown = self._buf[: partial_marker_start(self._buf, END)].rstrip()
        self._buf = self._buf[len(shown) :]
        self._shown_any = self._shown_any or bool(shown)
        return shown, False


class ReasoningParser:
    start, end = START, END  # the markers (what structured/reasoning_gate.py reads beside `implicit`)

    def __init__(self, name: str, implicit: bool):
        self.name, self.implicit = name, implicit

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.implicit)

    def explicit(self) -> ReasoningParser:
        """This format, reading reasoning only where the output writes `<think>` itself: for an
        output a grammar constrains (it cannot have started inside a reasoning)."""
        return ReasoningParser(self.name, False)

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a whole output; reasoning None when it has none (or it is empty)."""
        stream = self.stream()
        r1, c1 = stream.feed(text)
        r2, c2 = stream.finish()
        return (r1 + r2) or None, c1 + c2


PARSERS = {"qwen3": False, "deepseek_r1": True}  # name -> whether the output starts inside the reasoning


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser named `name` (None for None); ValueError naming the choices otherwise."""
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"reasoning_parser={name!r}: unknown; choose one of {', '.join(sorted(PARSERS))}")
    return ReasoningParser(name, PARSERS[name])
