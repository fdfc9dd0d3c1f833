"""llguidance matchers over our tokenizers, and the packed bitmasks the sampler applies.

The vocabulary llguidance sees is built once per engine, lazily (on the first constrained
request): an HF `tokenizers` tokenizer is handed over as its JSON; a sentencepiece one as the
byte string of every piece. Its size is the model's vocabulary (the logits' width), which may be
larger than the tokenizer's; ids the tokenizer lacks are never allowed. Compiled grammars are
cached by spec, so a schema sent with every request is compiled once.
"""

from __future__ import annotations

import collections
import re
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from jaxinfer.sampling.params import SamplingParams, StructuredOutput
from jaxinfer.structured.grammar import grammar_text
from jaxinfer.structured.matcher import RowMatcher, Vocabulary
from jaxinfer.structured.reasoning_gate import ReasoningFormat, ReasoningGate, ReasoningMarkers, reasoning_markers
from jaxinfer.structured.slices import grammar_slices

if TYPE_CHECKING:
    from llguidance import LLExecutor, LLTokenizer

_CACHE_SIZE = 128
# llguidance tokenizers with a grammar's own slices (see slices.py), by slice set. Each holds
# tries of the whole vocabulary (~13 MiB for a 49k one) and takes ~0.1-0.3 s to build. Evicting
# one drops the compiled grammars built on it, so memory stays bounded whatever clients send
# (a running request's matcher keeps its own until the request ends).
_SLICED_CACHE_SIZE = 4


class Grammar:
    """A compiled, validated grammar: makes one matcher per sequence (a RowMatcher, gated behind
    the reasoning where the backend has a reasoning parser)."""

    def __init__(
        self,
        tokenizer: LLTokenizer,
        text: str,
        spec: StructuredOutput,
        gate: Callable[[RowMatcher], ReasoningGate] | None = None,
    ) -> None:
        self._tokenizer, self.text, self.spec, self._gate = tokenizer, text, spec, gate

    def matcher(self) -> RowMatcher | ReasoningGate:
        matcher = self.row_matcher()
        return matcher if self._gate is None else self._gate(matcher)

    def row_matcher(self) -> RowMatcher:
        """The grammar's own matcher, from the first output token."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self._tokenizer, self.text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"StructuredOutput.{self.spec.kind}: {matcher.get_error()}")
        return RowMatcher(matcher)


class GrammarBackend:
    """llguidance's tokenizer for one engine's vocabulary, and a cache of compiled grammars;
    with a `reasoning` format, grammars constrain what follows the reasoning (reasoning_gate.py)."""

    def __init__(self, tokenizer: Vocabulary, vocab_size: int, reasoning: ReasoningFormat | None = None) -> None:
        self.tokenizer, self.vocab_size, self.reasoning = tokenizer, vocab_size, reasoning
        self._markers: ReasoningMarkers | None = None
        self._ll: LLTokenizer | None = None
        self._cache: collections.OrderedDict[StructuredOutput, Grammar] = collections.OrderedDict()
        self._sliced: collections.OrderedDict[tuple[str, ...], LLTokenizer] = collections.OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput) -> Grammar:
        """ValueError "StructuredOutput.<field>: ..." for a spec llguidance cannot compile."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        text = grammar_text(spec)
        gate = None if self.reasoning is None else self._gate
        grammar = Grammar(self._sliced_tokenizer(grammar_slices(spec)), text, spec, gate)
        grammar.row_matcher()  # compiles it once: errors surface here, at the request
        with self._lock:
            if not self._evicted(grammar._tokenizer):
                self._cache[spec] = grammar
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def _gate(self, matcher: RowMatcher) -> ReasoningGate:
        with self._lock:  # the vocabulary's markers, read once (a pass over every token)
            if self._markers is None:
                if self.reasoning is None:  # never: compile gates only with a reasoning format
                    raise ValueError("a reasoning gate without a reasoning format")
                self._markers = reasoning_markers(self.tokenizer, self.reasoning, self.vocab_size)
        return ReasoningGate(matcher, self._markers)

    def _ll_tokenizer(self) -> LLTokenizer:
        with self._lock:
            if self._ll is None:
                self._ll = _build_ll_tokenizer(self.tokenizer, self.vocab_size)
            return self._ll

    def _evicted(self, tokenizer: LLTokenizer) -> bool:
        return tokenizer is not self._ll and all(t is not tokenizer for t in self._sliced.values())

    def _sliced_tokenizer(self, slices: tuple[str, ...]) -> LLTokenizer:
        """The vocabulary with `slices` ahead of llguidance's defaults (the same tokenizer when
        there are none, or none that llguidance's regex syntax accepts)."""
        base = self._ll_tokenizer()
        slices = tuple(s for s in slices if _is_regex(s))
        if not slices:
            return base
        with self._lock:
            if slices in self._sliced:
                self._sliced.move_to_end(slices)
                return self._sliced[slices]
        sliced = base.with_slices(list(slices) + base.general_slices())
        with self._lock:
            self._sliced[slices] = sliced
            while len(self._sliced) > _SLICED_CACHE_SIZE:
                _, evicted = self._sliced.popitem(last=False)
                for spec in [s for s, g in self._cache.items() if g._tokenizer is evicted]:
                    del self._cache[spec]
        return sliced


def _is_regex(text: str) -> bool:
    """llguidance's regex syntax accepts `text` (its slicer panics on one it does not)."""
    from llguidance import LLMatcher

    try:
        return not LLMatcher.validate_grammar_with_warnings(LLMatcher.grammar_from_regex(text))[0]
    except (ValueError, TypeError, RuntimeError):
        return False


def grammar_for(backend: GrammarBackend | None, params: SamplingParams) -> Grammar | None:
    """The compiled grammar of a request's SamplingParams (None when unconstrained)."""
    if params.structured_output is None:
        return None
    if backend is None:
        raise ValueError("SamplingParams.structured_output needs a tokenizer; this engine has none")
    return backend.compile(params.structured_output)


_EXECUTORS: dict[bool, LLExecutor] = {}


def fill_bitmask(
    rows: Sequence[tuple[RowMatcher | ReasoningGate, int]], allowed: np.ndarray, device_busy: bool = False
) -> None:
    """Fills the rows of `allowed` [B, W] (int32, C-contiguous) of the matchers given; several
    rows are computed in parallel by llguidance's thread pool. While the device is idle (the step
    before has landed and nothing runs) the pool has every core this process may use; while a
    forward runs beside it (`device_busy`, the split step) llguidance's default, 80% of them,
    leaves room for the runtime's own threads (and on the CPU backend, for the forward itself)."""
    grammar_rows = [(g, row) for g, row in ((m.grammar_row, row) for m, row in rows) if g is not None]
    if len(grammar_rows) == 1:
        matcher, row = grammar_rows[0]
        matcher.fill(allowed[row])
    elif grammar_rows:
        import llguidance.numpy as lln

        lln.fill_next_token_bitmask_par(_executor(device_busy), [(m._m, row) for m, row in grammar_rows], allowed)
    for gate, row in rows:  # a reasoning gate's own bits (every token in the reasoning)
        gate.add_bits(allowed[row])


def _executor(device_busy: bool) -> LLExecutor:
    import os

    import llguidance

    if device_busy not in _EXECUTORS:
        threads = None if device_busy else max(1, min(32, len(os.sched_getaffinity(0))))
        _EXECUTORS[device_busy] = llguidance.LLExecutor(threads)
    return _EXECUTORS[device_busy]


def _build_ll_tokenizer(tokenizer: Vocabulary, vocab_size: int) -> LLTokenizer:
    from llguidance import LLTokenizer, TokenizerWrapper

    eos = list(tokenizer.eos_token_ids) or None
    backend_json = getattr(tokenizer, "backend_json", None)
    if backend_json is not None:
        return LLTokenizer(backend_json(), n_vocab=vocab_size, eos_token=eos)
    return LLTokenizer(TokenizerWrapper(_PieceVocabulary(tokenizer, vocab_size)), n_vocab=vocab_size, eos_token=eos)


class _PieceVocabulary:
    """What llguidance's TokenizerWrapper reads of a sentencepiece vocabulary: every id's bytes."""

    _BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

    def __init__(self, tokenizer: Vocabulary, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else 0
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = [i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)]
        self.tokens = [self._bytes(i) if i < tokenizer.vocab_size else b"" for i in range(vocab_size)]
        self._newline = tokenizer.encode("\n", add_special_tokens=False)

    def _bytes(self, i: int) -> bytes:
        piece = self._tokenizer.id_to_token(i) or ""  # a sentencepiece vocabulary names every id
        if self._tokenizer.is_special(i):
            return piece.encode()
        byte = self._BYTE_PIECE.fullmatch(piece)
        if byte:
            return bytes([int(byte.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    def __call__(self, text: str | bytes) -> list[int]:
        """Token ids of `text` exactly, without sentencepiece's dummy-prefix space: the text is
        encoded after a newline, whose tokens are then dropped."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        ids = self._tokenizer.encode("\n" + text, add_special_tokens=False)
        return ids[len(self._newline) :] if ids[: len(self._newline)] == self._newline else ids
