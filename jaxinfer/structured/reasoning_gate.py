"""Structured output for reasoning models: the grammar constrains the answer, not the thinking.

    backend = GrammarBackend(tokenizer, vocab_size, reasoning=reasoning_parser("qwen3"))
    backend.compile(spec).matcher()     # a ReasoningGate around the grammar's matcher

    markers = reasoning_markers(tokenizer, form, vocab_size)    # what the backend does, once
    matcher = ReasoningGate(row_matcher, markers)               # one per sequence

A reasoning model writes `<think> ... </think>` and then its answer (tokenizer/reasoning.py). With
a reasoning parser set (EngineConfig.reasoning_parser), a constrained request's matcher is gated,
as vLLM gates its grammars behind the reasoning:
- `qwen3` (reasoning only where the output opens with `<think>`): the first token is the
  grammar's first or `<think>` (where `<think>` is one token); after `<think>`, any token until
  `</think>`. A first token of the grammar's starts the answer at once (thinking switched off).
- `deepseek_r1` (the output starts inside the reasoning): any token until `</think>`.
Past `</think>`, whitespace-only tokens may come before the grammar's first (the blank line these
models write there); from the first other token on, the grammar alone, fed every token.
`</think>` is recognised as its token where it is one; where it is several, in the reasoning's
decoded text (a model need not write it as the tokenizer's own encoding: ">\n" may be one token).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import numpy as np

from jaxinfer.structured.matcher import RowMatcher, Vocabulary


class ReasoningFormat(Protocol):
    """What the gate reads of a reasoning format (tokenizer/reasoning.py's ReasoningParser)."""

    implicit: bool  # the output starts inside the reasoning (deepseek_r1)
    start: str  # `<think>`
    end: str  # `</think>`


@dataclasses.dataclass(frozen=True)
class ReasoningMarkers:
    """A vocabulary's view of a reasoning format."""

    implicit: bool  # the output starts inside the reasoning (deepseek_r1)
    end: str  # `</think>`
    start_id: int | None  # `<think>` where it is one token (qwen3's explicit opening); else None
    end_id: int | None  # `</think>` where it is one token; else it is found in decoded text
    whitespace: np.ndarray  # packed allowed-token bits (uint32 [W]) of the whitespace-only tokens
    piece: Callable[[int], str]  # one token's text (for an end marker of several tokens)


def reasoning_markers(tokenizer: Vocabulary, form: ReasoningFormat, vocab_size: int) -> ReasoningMarkers:
    """The markers of a reasoning format in `tokenizer`'s vocabulary."""
    start, end = (tokenizer.encode(m, add_special_tokens=False) for m in (form.start, form.end))
    whitespace = np.zeros(-(-vocab_size // 32), np.uint32)
    for i in range(min(vocab_size, tokenizer.vocab_size)):
        if not tokenizer.is_special(i) and _is_blank(tokenizer.decode([i], skip_special_tokens=False)):
            whitespace[i >> 5] |= np.uint32(1 << (i & 31))
    return ReasoningMarkers(
        form.implicit,
        form.end,
        start[0] if len(start) == 1 else None,
        end[0] if len(end) == 1 else None,
        whitespace,
        lambda i: tokenizer.decode([i], skip_special_tokens=False),
    )


def _is_blank(text: str) -> bool:
    return bool(text) and not text.strip() and "\ufffd" not in text


class ReasoningGate:
    """A RowMatcher (structured.backend) that lets the reasoning through. States: `start` (qwen3:
    thinking or answer), `reasoning`, `after` (past `</think>`, before the answer's first
    non-blank token) and `answer` (the grammar's)."""

    def __init__(self, inner: RowMatcher, markers: ReasoningMarkers) -> None:
        self._inner, self._markers = inner, markers
        self._state = "reasoning" if markers.implicit else "start"
        self._tail = ""  # the reasoning's last characters (an end marker of several tokens)

    @property
    def state(self) -> str:
        return self._state

    def consume(self, token: int) -> bool:
        token = int(token)
        if self._state == "start":
            if token == self._markers.start_id:
                self._state = "reasoning"
                return True
            self._state = "answer"
        elif self._state == "reasoning":
            if self._markers.end_id is not None:
                ended = token == self._markers.end_id
            else:
                end = self._markers.end
                self._tail = (self._tail + self._markers.piece(token))[-2 * len(end) :]
                ended = end in self._tail
            if ended:
                self._state = "after"
            return True
        elif self._state == "after":
            if self._bit(self._markers.whitespace, token):
                return True
            self._state = "answer"
        return self._inner.consume(token)

    @property
    def is_finished(self) -> bool:
        return self._state == "answer" and self._inner.is_finished

    @property
    def error(self) -> str | None:
        return self._inner.error if self._state == "answer" else None

    @property
    def grammar_row(self) -> RowMatcher | None:
        """The matcher whose bits the next token's row starts from (None: every token, in the
        reasoning); structured.fill_bitmask fills such rows together, then calls `add_bits`."""
        return None if self._state == "reasoning" else self._inner

    def add_bits(self, row: np.ndarray) -> None:
        """What the gate allows beside the grammar, into `row` (int32 [W]) after its fill."""
        bits = row.view(np.uint32)
        if self._state == "reasoning":
            bits[:] = np.uint32(0xFFFFFFFF)
        elif self._state == "after":
            bits |= self._markers.whitespace
        elif self._state == "start" and self._markers.start_id is not None:
            bits[self._markers.start_id >> 5] |= np.uint32(1 << (self._markers.start_id & 31))

    def fill(self, row: np.ndarray) -> None:
        """The next token's allowed bits into `row` (int32 [W]): all of them in the reasoning."""
        if self.grammar_row is not None:
            self._inner.fill(row)
        self.add_bits(row)

    @staticmethod
    def _bit(bits: np.ndarray, token: int) -> bool:
        return 0 <= token < bits.size * 32 and bool(bits[token >> 5] >> np.uint32(token & 31) & 1)
