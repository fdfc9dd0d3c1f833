"""Token-trie slices for llguidance's mask computation, derived from what a grammar repeats.

llguidance computes a mask by walking the vocabulary's token trie through the grammar's lexer.
Its "slicer" splits the vocabulary into slices by regular expression (a token joins the first
slice it matches in full) and, where the lexer's state accepts every string of a slice, sets that
slice's tokens at once instead of walking them. Its default slices are JSON string contents.

A counted repetition such as `[a-z ]{256}` gets nothing from those: every count is a lexer state
of its own, and each new state walks the whole trie (SmolLM2's vocabulary: ~0.4-0.6 ms per row
and token, against ~0.05 for `[a-z ]+`). A slice of the repeated class itself, `[a-z ]{1,16}`,
is accepted whole while 16 or more repetitions remain, which cuts that cost ~6x. Slices are an
optimisation only: llguidance checks that the state accepts the slice before using it, so a slice
never changes a mask.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from jaxinfer.sampling.params import StructuredOutput

# A character class (bracket expression, `.`, or \d \w \s and their negations) followed by a
# repetition (group 2): `*`, `+`, `{n}`, `{n,}` or `{n,m}`.
_REPEATED_CLASS = re.compile(r"(\[\^?\]?(?:\\.|[^\]\\])*\]|\\[dwsDWS]|(?<!\\)\.)([*+]|\{\d+(?:,\d*)?\})")
_COUNT = re.compile(r"\{(\d+)(?:,(\d*))?\}$")
# Tokens longer than this rarely consist of one class; a longer slice is subsumed less often.
SLICE_TOKENS = 16
# Shorter runs than this are not worth a slice (each one adds a lexeme to every grammar's lexer).
MIN_RUN = 4
MAX_SLICES = 4


def grammar_slices(spec: StructuredOutput) -> tuple[str, ...]:
    """The slices for `spec`: `C{1,L}` for each character class C the regex, Lark grammar or JSON
    schema patterns repeat at least MIN_RUN times (L = min(run, SLICE_TOKENS)), first seen first,
    at most MAX_SLICES. Empty for a spec that repeats no class (llguidance's defaults serve)."""
    slices: list[str] = []
    for source in _sources(spec):
        for match in _REPEATED_CLASS.finditer(source):
            cls, run = match.group(1), _run_length(match.group(2))
            if run < MIN_RUN:
                continue
            piece = f"{cls}{{1,{min(run, SLICE_TOKENS)}}}"
            if piece not in slices:
                slices.append(piece)
            if len(slices) == MAX_SLICES:
                return tuple(slices)
    return tuple(slices)


def _run_length(quantifier: str) -> int:
    """How many repetitions the quantifier allows at most (unbounded -> SLICE_TOKENS)."""
    count = _COUNT.match(quantifier)
    if count is None:  # * or +
        return SLICE_TOKENS
    low, high = count.group(1), count.group(2)
    if high is None:  # {n}
        return int(low)
    return SLICE_TOKENS if high == "" else int(high)


def _sources(spec: StructuredOutput) -> list[str]:
    if spec.regex is not None:
        return [spec.regex]
    if spec.grammar is not None:
        return [spec.grammar]
    if spec.kind == "json":
        return list(_patterns(spec.json))
    return []


def _patterns(schema: Any) -> Iterator[str]:
    """Every "pattern" string of a JSON schema, at any depth."""
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key == "pattern" and isinstance(value, str):
                yield value
            else:
                yield from _patterns(value)
    elif isinstance(schema, list):
        for item in schema:
            yield from _patterns(item)
