"""SpeculativeConfig: which proposer drafts tokens and how many (vLLM's `speculative_config`).

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    {"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}

Parsed from a dict (or its JSON text) where the engine is configured, before any model is loaded;
a bad key or value is a ValueError naming it. Plain Python (the proposers live in spec_decode/).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import NoReturn

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # the static width of the verify step's draft rows


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4  # ngram: the longest suffix looked up in the sequence's tokens
    prompt_lookup_min: int = 1  # ngram: the shortest
    model: str | None = None  # draft_model: a model directory or .gguf with the same vocabulary

    def __post_init__(self):
        def bad(name: str, why: str) -> NoReturn:
            raise ValueError(f"speculative_config.{name}={getattr(self, name)!r}: {why}")

        if self.method not in METHODS:
            bad("method", f"expected one of {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            bad("num_speculative_tokens", f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}]")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                bad(name, "must be an integer >= 1")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            bad("prompt_lookup_min", f"must be <= prompt_lookup_max={self.prompt_lookup_max}")
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model):
            bad("model", "method draft_model needs the draft model's path")
        if self.method == "ngram" and self.model is not None:
            bad("model", "method ngram takes no model (did you mean method draft_model?)")

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping | str | None) -> SpeculativeConfig | None:
        """A SpeculativeConfig from a dict, its JSON text, or itself; None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config {value!r:.80}: not valid JSON ({e.msg})") from None
        if not isinstance(value, Mapping):
            raise ValueError(
                f"speculative_config={value!r:.80}: must be an object such as "
                '{"method": "ngram", "num_speculative_tokens": 4}'
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"speculative_config.{unknown[0]}: unknown key (known: {', '.join(sorted(names))})")
        for required in ("method", "num_speculative_tokens"):
            if required not in value:
                raise ValueError(f"speculative_config.{required}: required")
        return cls(**value)
