"""StructuredOutput -> llguidance grammar text, validated (the error names the bad field)."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from jaxinfer.sampling.params import StructuredOutput

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # llguidance loads when a grammar compiles

# JSON output without free whitespace: what a strict json_schema reply looks like, and fewer
# tokens for the model to choose among. (llguidance's JSON options; see its docs.)
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar for `spec`. ValueError "StructuredOutput.<field>: ..." when the
    schema, regex or grammar is not one llguidance accepts."""
    kind = spec.kind
    try:
        return _checked(_text(spec, kind), kind)
    except (ValueError, TypeError, RuntimeError) as e:  # llguidance raises on some bad inputs
        raise ValueError(f"StructuredOutput.{kind}: {e}") from e


def _text(spec: StructuredOutput, kind: str) -> str:
    from llguidance import LLMatcher

    # `kind` names the one field set: json (or json_object), regex, choice or grammar.
    if spec.regex is not None:
        return LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return LLMatcher.grammar_from_regex("|".join(f"(?:{re.escape(c)})" for c in spec.choice))
    if spec.grammar is not None:
        return LLMatcher.grammar_from_lark(spec.grammar)
    schema = spec.json if kind == "json" else {"type": "object"}
    return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_OPTIONS)


def _checked(text: str, kind: str) -> str:
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(text)
    if is_error:
        raise ValueError("; ".join(m.strip() for m in messages)[:500])
    return text
