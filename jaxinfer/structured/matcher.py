"""RowMatcher: one sequence's position in its grammar (an llguidance matcher); Vocabulary: what
structured output reads of a tokenizer (jaxinfer.tokenizer's Tokenizer, which this package does
not import). The grammar backend (backend.py) makes matchers; a reasoning gate
(reasoning_gate.py) wraps one."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from llguidance import LLMatcher


class Vocabulary(Protocol):
    @property
    def vocab_size(self) -> int: ...
    @property
    def bos_token_id(self) -> int | None: ...
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str: ...
    def id_to_token(self, i: int) -> str | None: ...
    def is_special(self, i: int) -> bool: ...


class RowMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: LLMatcher) -> None:
        self._m = matcher

    def consume(self, token: int) -> bool:
        """Advances past a sampled token; False if the grammar rejects it (then the matcher is
        in an error state and allows only what llguidance allows in one: end of sequence)."""
        return bool(self._m.consume_token(int(token)))

    @property
    def is_finished(self) -> bool:
        """The grammar is complete: only end of sequence remains allowed."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None

    def fill(self, row: np.ndarray) -> None:
        """Writes the allowed-token bits of the next token into one row of `allowed`."""
        import llguidance.numpy as lln

        lln.fill_next_token_bitmask(self._m, row[None], 0)

    @property
    def grammar_row(self) -> RowMatcher:  # the interface fill_bitmask reads (reasoning_gate.py)
        return self

    def add_bits(self, row: np.ndarray) -> None:
        pass
