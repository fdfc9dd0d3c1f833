"""SamplingParams: how to sample one request, validated where it is built (no JAX).

The user-facing half of sampling. `arrays.py` turns a batch of these into numpy SamplingArrays
(one row per sequence) and `sampler.py` samples inside the jitted step; neither is imported
here, so the host side (jaxinfer.core) can hold SamplingParams without importing JAX.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np

MAX_LOGPROBS = 20
GREEDY_EPS = 1e-5  # temperatures below this sample greedily (dividing by them overflows)
FLOAT32_MAX = float(np.finfo(np.float32).max)  # float options travel to the device as float32


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_number(x) -> bool:
    """A real number that stays finite as float32 (1e300 would overflow on the device)."""
    return (isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)
            and abs(float(x)) <= FLOAT32_MAX)


def _as_tuple(value: object, item_ok: type | tuple[type, ...]) -> tuple | None:
    """A str/int or a list/tuple of them as a tuple; None when the value has another shape."""
    if value is None:
        return ()
    if isinstance(value, item_ok) and not isinstance(value, bool):
        return (value,) if isinstance(value, str) else None
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return None


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """Constrains a request's output; exactly one field is set (vLLM's guided decoding):
    `json` a JSON schema (dict or JSON text; the output is one JSON value it accepts),
    `json_object` any JSON object, `regex` a regular expression the whole output matches,
    `choice` one of these strings, `grammar` a Lark grammar (llguidance's dialect)."""
    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice) if isinstance(self.choice, (list, tuple))
                               else self.choice)
        set_ = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) not in (None, False)]
        if len(set_) != 1:
            raise ValueError("StructuredOutput: set exactly one of json, json_object, regex, choice, "
                             f"grammar (got {set_ or 'none'})")
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"StructuredOutput.json: not valid JSON ({e})") from e
            object.__setattr__(self, "json", schema)
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"StructuredOutput.json: a JSON schema must be an object, got {self.json!r:.60}")
        if self.json_object is not False and self.json_object is not True:
            raise ValueError(f"StructuredOutput.json_object={self.json_object!r}: must be a bool")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"StructuredOutput.{name}={value!r:.60}: must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, tuple) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"StructuredOutput.choice={self.choice!r:.60}: must be a non-empty list "
                             "of non-empty strings")

    @property
    def kind(self) -> str:
        return next(f.name for f in dataclasses.fields(self) if getattr(self, f.name) not in (None, False))

    def __hash__(self) -> int:  # a schema dict is not hashable; its canonical text is
        return hash(json.dumps(dataclasses.asdict(self), sort_keys=True, default=str))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Validated at construction; the bad value is named."""
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1                    # -1 or 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()         # a str or a list of str; matched on text by the engine
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None        # top-N logprobs per token, 0..MAX_LOGPROBS
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_output: StructuredOutput | None = None  # constrain the output (JSON, regex, ...)

    def __post_init__(self):
        for name, kind, what in (("stop", str, "a string or a list of strings"),
                                 ("stop_token_ids", int, "a list of token ids")):
            value = _as_tuple(getattr(self, name), kind)
            if value is None:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: must be {what}")
            object.__setattr__(self, name, value)
        self._validate()

    def _validate(self) -> None:
        def bad(name, why):
            raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        if not _is_int(self.n) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not _is_number(self.temperature) or not self.temperature >= 0:
            bad("temperature", f"must be a number in [0, {FLOAT32_MAX:.3g}] (0 = greedy)")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "must be -1 or 0 (off) or an integer >= 1")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty:
            bad("repetition_penalty", f"must be a number in (0, {FLOAT32_MAX:.3g}] (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                bad(name, "must be in [-2, 2]")
        if self.seed is not None and not _is_int(self.seed):
            bad("seed", "must be an integer or None")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a non-empty string or a list of non-empty strings")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of token ids >= 0")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be a bool")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            bad("structured_output", "must be a StructuredOutput or None")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)
