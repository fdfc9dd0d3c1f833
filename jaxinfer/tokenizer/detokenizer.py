"""Incremental detokenization: generated ids in, newly finished text out, one step at a time.

Decoding one token on its own is wrong in two ways: a character can be split over several byte
tokens (its first bytes decode to U+FFFD), and sentencepiece-style decoders drop the space of the
text's first piece ("▁Hello" alone is "Hello", after "Hi" it is " Hello"). So each step decodes a
short window of ids twice, as vLLM's detokenize_incrementally does:

    ids:   ... | prefix ........ read | new ids
                 \\_ prefix_text _/
    text = decode(ids[prefix:]);  emitted = text[len(prefix_text):]

The window starts one step back, so the first new piece is never the window's first piece and
keeps its space. While `text` ends in U+FFFD the step emits nothing and waits for the rest of
the character; once it is whole, the window moves on: prefix <- read, read <- end. Window starts
therefore sit on character boundaries, and each step costs the size of the last two steps, not
of the whole sequence. Special ids are dropped up front when skipping them (decode with
skip_special_tokens is decode of the remaining ids), so they never split a character or a space.

For well-formed UTF-8 output, the concatenation of every `step` and `flush` equals
`tokenizer.decode(all_ids)`. Bytes that never form a character (a model emitting garbage) keep
the window growing until a token ends the text cleanly; sentencepiece and byte-level BPE decoders
still give the exact text then. One case cannot be exact: a tokenizer.json whose decoder has
`ByteFallback` decodes a run of <0xNN> pieces as a whole, so a stray invalid byte turns the run's
earlier, already emitted characters into U+FFFD in the one-shot decode.
"""

from __future__ import annotations

from collections.abc import Iterable

from jaxinfer.tokenizer.base import Tokenizer

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt ids kept as left context for the first generated piece


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Iterable[int] | None = None, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = self._kept(prompt_ids or ())
        start = self._context_start(context)
        self._ids = context[start:]  # only the window is kept: [prefix, end)
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)

    def step(self, new_ids: Iterable[int]) -> str:
        """Text finished by `new_ids` (possibly "", while a character is incomplete)."""
        self._ids.extend(self._kept(new_ids))
        if len(self._ids) == self._read:
            return ""
        text = self._decode(self._ids)
        if text.endswith(_REPLACEMENT):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """Whatever is still held back (an unfinished character decodes to U+FFFD here)."""
        if len(self._ids) == self._read:
            return ""
        return self._advance(self._decode(self._ids))

    def _advance(self, text: str) -> str:
        new_text = _after(text, self._prefix_text)
        del self._ids[: self._read]  # the next window starts at the old read offset
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return new_text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def _kept(self, ids: Iterable[int]) -> list[int]:
        ids = [int(i) for i in ids]
        if self._skip:
            ids = [i for i in ids if not self._tokenizer.is_special(i)]
        return ids

    def _context_start(self, prompt: list[int]) -> int:
        """Where the prompt context starts: about _PROMPT_CONTEXT ids back, moved further back
        (a little) while that would start inside a character split over byte tokens."""
        start = max(len(prompt) - _PROMPT_CONTEXT, 0)
        while start > max(len(prompt) - 4 * _PROMPT_CONTEXT, 0):
            if not self._decode(prompt[start:]).startswith(_REPLACEMENT):
                break
            start -= 1
        return start


def _after(text: str, prefix: str) -> str:
    """`text` past `prefix`. They agree on all of `prefix` unless a prompt context ended inside a
    character; then the part from the first difference on is new."""
    if text.startswith(prefix):
        return text[len(prefix) :]
    common = 0
    for a, b in zip(text, prefix):
        if a != b:
            break
        common += 1
    return text[common:]
