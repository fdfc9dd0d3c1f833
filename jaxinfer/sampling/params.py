"""SamplingParams: how to sample one request, validated where it is built (no JAX).

The user-facing half of sampling. `arrays.py` turns a batch of these into numpy SamplingArrays
(one row per sequence) and `sampler.py` samples inside the jitted step; neither is imported
here, so the host side (jaxinfer.core) can hold SamplingParams without importing JAX.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping

import numpy as np

from jaxinfer.options import APPEND, CSV, DISABLE, ENABLE, JSON, NONE, option
from jaxinfer.sampling.structured_output import StructuredOutput

MAX_LOGPROBS = 20
# logit_bias: at most this many tokens a request (300, OpenAI's cap; also the static width L of
# SamplingArrays.bias_ids), each biased by a number in [-MAX_BIAS, MAX_BIAS] (OpenAI's range).
MAX_LOGIT_BIAS = 300
MAX_BIAS = 100.0
GREEDY_EPS = 1e-5  # temperatures below this sample greedily (dividing by them overflows)
FLOAT32_MAX = float(np.finfo(np.float32).max)  # float options travel to the device as float32


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    """A real number that stays finite as float32 (1e300 would overflow on the device)."""
    return (
        isinstance(x, (int, float, np.integer, np.floating))
        and not isinstance(x, bool)
        and abs(float(x)) <= FLOAT32_MAX
    )


def _as_tuple(value: object, item_ok: type | tuple[type, ...]) -> tuple | None:
    """A str/int or a list/tuple of them as a tuple; None when the value has another shape."""
    if value is None:
        return ()
    if isinstance(value, item_ok) and not isinstance(value, bool):
        return (value,) if isinstance(value, str) else None
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return None


class LogitBias(dict):
    """SamplingParams.logit_bias once checked: {token id: bias}, read-only and hashable."""

    def _read_only(self, *args, **kwargs):
        raise TypeError("SamplingParams.logit_bias is read-only (build new SamplingParams)")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _read_only

    def __hash__(self) -> int:  # type: ignore[override]  # dict's is None: unhashable
        return hash(frozenset(self.items()))

    def __reduce__(self):  # copy / pickle without __setitem__
        return LogitBias, (dict(self),)

    @functools.cached_property
    def columns(self) -> tuple[np.ndarray, np.ndarray]:
        """(token ids i32[n], biases f32[n]), built once: a batch row is two slice copies."""
        ids = np.fromiter(self.keys(), np.int32, len(self))
        values = np.fromiter(self.values(), np.float32, len(self))
        ids.flags.writeable = values.flags.writeable = False
        return ids, values


def _logit_bias(value: object) -> LogitBias | None:
    """The checked bias of SamplingParams (None for none or {}); ValueError naming the bad entry."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"SamplingParams.logit_bias={value!r:.60}: must be a dict of token id -> bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"SamplingParams.logit_bias: {len(value)} tokens; at most {MAX_LOGIT_BIAS}")
    checked = {}
    for token, bias in value.items():
        if not _is_int(token) or token < 0:
            raise ValueError(f"SamplingParams.logit_bias[{token!r}]: a token id must be an integer >= 0")
        if not _is_number(bias) or not -MAX_BIAS <= bias <= MAX_BIAS:
            raise ValueError(
                f"SamplingParams.logit_bias[{token}]={bias!r}: must be a number in [{-MAX_BIAS:g}, {MAX_BIAS:g}]"
            )
        checked[int(token)] = float(bias)
    return LogitBias(checked) if checked else None


def logit_bias_from_json(value: object, name: str = "logit_bias") -> dict[int, object] | None:
    """OpenAI's JSON form, whose keys are strings ({"50256": -100}), as {50256: -100}; the
    values are left to SamplingParams. ValueError naming `name` and what is not a token id."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"{name}={value!r:.60}: must be an object of token id -> bias")
    out = {}
    for key, bias in value.items():
        if not (_is_int(key) or isinstance(key, str) and re.fullmatch(r"-?[0-9]+", key)):
            raise ValueError(f"{name}[{key!r}]: keys must be token ids (integers, as strings in JSON)")
        out[int(key)] = bias
    return out


def check_logit_bias_vocab(params: SamplingParams, vocab_size: int) -> None:
    """ValueError naming the ids of params.logit_bias outside the model's vocabulary [0, V)."""
    bad = sorted(t for t in params.logit_bias or () if t >= vocab_size)
    if bad:
        raise ValueError(
            f"SamplingParams.logit_bias[{bad[0]}]: token ids out of the vocabulary [0, {vocab_size}): {bad[:5]}"
        )


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Validated at construction; the bad value is named.

    Each field declares its help text and command-line form (jaxinfer/options.py): the CLI's
    sampling flags are generated from them; the command line decodes greedily, up to 128 tokens,
    by default."""

    n: int = option(1, "samples per prompt", flag="-n")
    # 0: compute the prompt (its prompt_logprobs) and generate nothing; such a prompt may fill
    # the whole context.
    max_tokens: int = option(16, "most tokens to generate", cli_default=128)
    temperature: float = option(1.0, "0 = greedy", cli_default=0.0)
    top_k: int = option(-1, "0 = off", cli_default=0)  # -1 or 0: off
    top_p: float = option(1.0, "sample from the smallest set of likeliest tokens whose probability reaches this")
    min_p: float = option(0.0, "drop tokens less likely than this fraction of the likeliest token's probability")
    repetition_penalty: float = option(
        1.0, "scales down the logits of tokens already in the prompt or output (1 = off)"
    )
    presence_penalty: float = option(0.0, "subtracted from the logits of tokens seen in the output (-2..2)")
    frequency_penalty: float = option(
        0.0, "subtracted from a token's logit once per time it occurs in the output (-2..2)"
    )
    seed: int | None = option(None, "per-request seed (reproducible sampling)")
    # A str or a list of str; matched on text by the engine.
    stop: tuple[str, ...] = option((), "stop string (repeatable)", form=APPEND)
    stop_token_ids: tuple[int, ...] = option((), "comma-separated token ids that end the output", form=CSV)
    ignore_eos: bool = option(False, "keep generating past the end-of-sequence token", form=ENABLE)
    logprobs: int | None = option(  # top-N logprobs per token, 0..MAX_LOGPROBS
        None, "each output token's logprob and the N most likely tokens' (0..20)", metavar="N"
    )
    # The logprob of each prompt token after the first (and its top-N, 0..MAX_LOGPROBS) under
    # the model: RequestOutput.prompt_logprobs. The engine needs enable_prompt_logprobs.
    prompt_logprobs: int | None = option(
        None,
        "each prompt token's logprob and the N most likely tokens' (0..20; the engine needs --enable-prompt-logprobs)",
        metavar="N",
    )
    include_stop_str_in_output: bool = option(False, "keep the stop string that ended the output in it", form=ENABLE)
    skip_special_tokens: bool = option(
        True, "keep special tokens in the output text", form=DISABLE, flag="--no-skip-special-tokens"
    )
    # Constrain the output (JSON, regex, ...): the flags of StructuredOutput's fields, one of them.
    structured_output: StructuredOutput | None = option(
        None, "constrain the output", form=NONE, not_on_cli="its flags are StructuredOutput's, one of them"
    )
    # {token id: bias} added to those tokens' logits after the penalties, before the structured-
    # output mask and before greedy or sampled choice (not to logprobs, which read the raw
    # logits); -100 bans a token, +100 all but forces it. At most MAX_LOGIT_BIAS entries.
    logit_bias: dict[int, float] | None = option(
        None,
        "token id -> bias added to its logit, e.g. '{\"123\": 5.0}' (each in [-100, 100]: -100 bans the "
        "token, 100 all but forces it)",
        form=JSON,
        metavar="JSON",
    )
    # Speculative decoding, when the engine has it on: False runs this request without drafts.
    # Requests with penalties or structured output never speculate (nor does a batch holding one
    # with penalties).
    speculative: bool = option(
        True, "decode these requests without drafts when the engine speculates", form=DISABLE, flag="--no-speculation"
    )

    def __post_init__(self):
        for name, kind, what in (
            ("stop", str, "a string or a list of strings"),
            ("stop_token_ids", int, "a list of token ids"),
        ):
            value = _as_tuple(getattr(self, name), kind)
            if value is None:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: must be {what}")
            object.__setattr__(self, name, value)
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        self._validate()

    def _validate(self) -> None:
        def bad(name, why):
            raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        if not _is_int(self.n) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            bad("max_tokens", "must be an integer >= 0 (0: score the prompt, generate nothing)")
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
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                bad(name, f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "speculative"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be a bool")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            bad("structured_output", "must be a StructuredOutput or None")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
