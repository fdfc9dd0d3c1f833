"""Structured output on the host (no JAX): response formats -> grammars -> per-row token bitmasks.

    backend = GrammarBackend(tokenizer, vocab_size)      # llguidance's view of the vocabulary
    grammar = backend.compile(StructuredOutput(json=schema))   # ValueError naming a bad spec
    matcher = grammar.matcher()                           # one per sequence
    fill_bitmask([(matcher, row), ...], allowed)          # rows of SamplingArrays.allowed
    matcher.consume(token)                                # after each sampled token

The grammar engine is llguidance (a Rust library; packed bitmasks in the layout the sampler
reads). A grammar that repeats a character class gets that class as a vocabulary slice of its
own (slices.py), which spares llguidance most of its token-trie walk while the run lasts.
xgrammar needs torch, which this project's Python 3.12 environments do not have.
"""

from jaxinfer.structured.backend import Grammar, GrammarBackend, fill_bitmask, grammar_for
from jaxinfer.structured.grammar import grammar_text
from jaxinfer.structured.matcher import RowMatcher
from jaxinfer.structured.reasoning_gate import ReasoningFormat, ReasoningGate

__all__ = [
    "Grammar",
    "GrammarBackend",
    "ReasoningFormat",
    "ReasoningGate",
    "RowMatcher",
    "fill_bitmask",
    "grammar_for",
    "grammar_text",
]
