"""Slices derived from a grammar's repeated character classes: which ones, and that a matcher
built on them gives the masks llguidance's default slicing gives, token after token."""

from __future__ import annotations

import numpy as np
import pytest
from testpaths import sentencepiece_model_path

from jaxinfer.sampling import StructuredOutput
from jaxinfer.structured import GrammarBackend, fill_bitmask
from jaxinfer.structured.backend import _SLICED_CACHE_SIZE, RowMatcher, _is_regex
from jaxinfer.structured.slices import grammar_slices
from jaxinfer.tokenizer import load_tokenizer


def test_slices_name_each_repeated_class_once_with_its_run():
    assert grammar_slices(StructuredOutput(regex="[a-z ]{256}")) == ("[a-z ]{1,16}",)
    assert grammar_slices(StructuredOutput(regex=r"[A-Z][a-z]+( [a-z]{2,6})*\d{3}-\d{4}")) == (
        "[a-z]{1,16}",
        "[a-z]{1,6}",
        r"\d{1,4}",
    )  # [A-Z] once and \d{3} are too short
    assert grammar_slices(StructuredOutput(regex="[]x]{5}[^]y]{9,}.*")) == ("[]x]{1,5}", "[^]y]{1,16}", ".{1,16}")
    assert grammar_slices(StructuredOutput(regex=r"a\.{9}b")) == ()  # an escaped dot is no class
    lark = 'start: WORD " " NUM\nWORD: /[a-z]+/\nNUM: /[0-9]{1,5}/'
    assert grammar_slices(StructuredOutput(grammar=lark)) == ("[a-z]{1,16}", "[0-9]{1,5}")
    schema = {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-F0-9]{8,}$"},
            "tags": {"type": "array", "items": {"pattern": "[a-z]{4}"}},
        },
    }
    assert grammar_slices(StructuredOutput(json=schema)) == ("[A-F0-9]{1,16}", "[a-z]{1,4}")
    assert grammar_slices(StructuredOutput(choice=["aaaa", "b"])) == ()
    assert grammar_slices(StructuredOutput(json_object=True)) == ()
    many = "".join(f"[{c}-z]{{9}}" for c in "abcdef")
    assert len(grammar_slices(StructuredOutput(regex=many))) == 4


def test_only_slices_llguidance_parses_are_used():
    assert _is_regex("[a-z ]{1,16}") and _is_regex(r"\d{1,4}")
    assert not _is_regex("[z-a]{1,5}") and not _is_regex("(ab{1,4}")


@pytest.fixture(scope="module")
def backend():
    tok = load_tokenizer(sentencepiece_model_path())
    return GrammarBackend(tok, tok.vocab_size)


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutput(regex="[a-z ]{64}"),
        StructuredOutput(regex=r"[A-Z][a-z]{2,20}( [a-z]+){3,}\.\d{5}"),
        StructuredOutput(
            json={
                "type": "object",
                "required": ["id", "note"],
                "additionalProperties": False,
                "properties": {
                    "id": {"type": "string", "pattern": "^[a-f0-9]{24}$"},
                    "note": {"type": "string", "maxLength": 20},
                },
            }
        ),
    ],
    ids=["counted", "words", "json-pattern"],
)
def test_sliced_masks_equal_the_default_slicing_token_by_token(backend, spec):
    """Both matchers take the same random allowed tokens for 40 steps (or to the grammar's end);
    every mask is bit for bit the same, and the sliced one really holds the grammar's slices."""
    from llguidance import LLMatcher

    grammar = backend.compile(spec)
    assert grammar._tokenizer is not backend._ll_tokenizer()
    sliced, plain = grammar.matcher(), RowMatcher(LLMatcher(backend._ll_tokenizer(), grammar.text, log_level=0))
    words = -(-backend.vocab_size // 32)
    rng = np.random.default_rng(0)
    for step in range(40):
        masks = np.zeros((2, words), np.int32)
        fill_bitmask([(sliced, 0)], masks[:1])
        fill_bitmask([(plain, 0)], masks[1:])
        np.testing.assert_array_equal(masks[0], masks[1], err_msg=f"step {step}")
        bits = np.unpackbits(masks[0].view(np.uint8), bitorder="little")[: backend.vocab_size]
        choices = np.flatnonzero(bits)
        choices = [t for t in choices if t not in backend.tokenizer.eos_token_ids] or choices
        if sliced.is_finished or not len(choices):
            break
        token = int(rng.choice(choices))
        assert sliced.consume(token) and plain.consume(token)
    assert step > 10


def test_sliced_tokenizers_are_shared_by_slice_set(backend):
    a = backend.compile(StructuredOutput(regex="x[a-z ]{40}"))
    b = backend.compile(StructuredOutput(regex="y[a-z ]{40}"))
    c = backend.compile(StructuredOutput(regex="no repeats"))
    assert a._tokenizer is b._tokenizer and c._tokenizer is backend._ll_tokenizer()


def test_few_sliced_tokenizers_live_and_their_grammars_go_with_them():
    """Each slice set's tokenizer holds tries of the whole vocabulary: past _SLICED_CACHE_SIZE
    sets the oldest is dropped together with the compiled grammars built on it."""
    tok = load_tokenizer(sentencepiece_model_path())
    backend = GrammarBackend(tok, tok.vocab_size)
    specs = [StructuredOutput(regex=f"[{c}-z]{{20}}") for c in "abcdefgh"[: _SLICED_CACHE_SIZE + 1]]
    grammars = [backend.compile(spec) for spec in specs]
    assert len({id(g._tokenizer) for g in grammars}) == len(specs)
    assert len(backend._sliced) == _SLICED_CACHE_SIZE
    assert specs[0] not in backend._cache and all(s in backend._cache for s in specs[1:])
    assert backend.compile(specs[0]) is not grammars[0]  # compiled again, on a new tokenizer
    assert specs[1] not in backend._cache
