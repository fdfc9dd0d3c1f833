"""Host to device: a batch of SamplingParams -> SamplingArrays (numpy rows, padded).

    make_sampling_arrays(params, num_generated, seeds, histories, batch_size)
      (or sampling_arrays_for_sequences(scheduler sequences, batch_size))
    -> SamplingArrays: one row per sequence slot, padding rows greedy with every filter off

Every per-request option is an array row, so a new mix of options never recompiles; only the
batch bucket and the penalty-history width (or its absence) are static structure.

Structured output: `allowed` holds each row's allowed tokens as packed bits (llguidance's layout:
bit j of word w allows token 32*w + j; -1 = every token), filled on the host by
jaxinfer.structured for the rows with a grammar and applied by the sampler. Its width is static
(ceil(vocab / 32) when the vocabulary size is given, else 1: no masking at all), so a batch with
or without constrained rows runs the same compiled step.

Logit bias: each row's biased token ids, packed at the front of `bias_ids` [B, L] (-1 pads), and
their biases in `bias_values`; L = MAX_LOGIT_BIAS always, so a biased batch runs the same compiled
step as an unbiased one. The biases travel as float16, rounded to its 11 significant bits (every
multiple of 1/16 in [-100, 100] is exact; the logits they are added to are float32): 6 bytes a
slot, 1.8 KB a row, a ninth of what the allowed-token bits of a 128k vocabulary cost a row.

Defaults that need not travel: when no row of a batch has a grammar, or none has a logit bias,
the builder leaves `allowed`, or the bias pair, None (`unsent_defaults`) and the compiled step fills them
on the device from arrays it keeps (`fill_defaults`), so a plain batch does not upload its all-set
bits (4 MB a step at batch 256 with a 128k vocabulary) or its empty bias rows.

Plain arrays: when every row is greedy and none asks for top logprobs, a bias, a grammar or a
penalty (`is_plain`), the compiled step may mark the arrays `plain` (static) for the decode step's greedy
twin, whose sampler takes the argmax with no conditional; their unsent defaults stay unsent.

Penalty histories: a row's prompt ids (only when its repetition penalty is on) then its output
ids, padded with -1 to a width H. The transfer is B*H int32 per step instead of B*V; the [B, V]
counts are built on the device (sampler.apply_penalties). When no row of a batch uses penalties
the history is None (a separate compiled variant) and the step pays nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import flax.struct
import jax
import numpy as np

from jaxinfer.sampling.params import GREEDY_EPS, MAX_LOGIT_BIAS, LogitBias, SamplingParams

BIAS_DTYPE = np.float16  # SamplingArrays.bias_values (module docstring)
UNSENT_DEFAULTS = ("allowed", "bias_ids", "bias_values")  # None when every row has the default
HostOrDevice = np.ndarray | jax.Array  # a batch's arrays: numpy as built, jax.Array where placed


class SequenceLike(Protocol):
    """What a row needs of a scheduler sequence (jaxinfer.core.sequence.Sequence)."""

    sampling_params: SamplingParams
    seed: int  # the 64-bit stream seed

    @property
    def num_output_tokens(self) -> int: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def output_token_ids(self) -> list[int]: ...


@flax.struct.dataclass(frozen=True)  # as flax makes it; said for the type checker: `A` is covariant
class PenaltyHistory[A]:
    token_ids: A  # i32[B, H] prompt ids (if the row's repetition penalty is on), then
    # output ids; -1 pads
    num_prompt: A  # i32[B]    how many leading ids of the row are prompt ids


@flax.struct.dataclass(frozen=True)  # as flax makes it; said for the type checker: `A` is covariant
class SamplingArrays[A]:
    """One row per sequence of the batch; padding rows are greedy with every filter off.

    `A`, the type of every array: np.ndarray as the host builds them, jax.Array once placed (a
    tracer inside the step); a tree map may put other leaves in their place (their shardings)."""

    temperature: A  # f32[B] 0 = greedy
    top_k: A  # i32[B] 0 = off
    top_p: A  # f32[B] 1 = off
    min_p: A  # f32[B] 0 = off
    repetition_penalty: A  # f32[B] 1 = off
    presence_penalty: A  # f32[B] 0 = off
    frequency_penalty: A  # f32[B] 0 = off
    seeds: A  # u32[B, 2] the sequence's 64-bit seed as (low, high) words
    num_generated: A  # i32[B] output tokens so far: which draw of the stream this is
    num_top_logprobs: A  # i32[B] top-N logprobs asked for (0: none; no row >0: no top-k)
    allowed: A | None  # i32[B, W] packed allowed-token bits, -1 = all (W = 1: no masking)
    bias_ids: A | None  # i32[B, L] logit-bias token ids, packed at the front; -1 pads
    bias_values: A | None  # f16[B, L] the bias added to each of those tokens' logits
    # allowed / bias pair None: every row's default, filled before the step (fill_defaults)
    history: PenaltyHistory[A] | None = None  # None: no row uses penalties (static structure)
    # Static: every row greedy with no top logprobs, bias, grammar or penalty (is_plain), so the
    # sampler takes the argmax with no conditional; a compiled variant of its own (sampler.py).
    plain: bool = flax.struct.field(pytree_node=False, default=False)


def make_sampling_arrays(
    params: Sequence[SamplingParams],
    num_generated: Sequence[int],
    *,
    batch_size: int,
    seeds: Sequence[int] | None = None,
    prompt_token_ids: Sequence[Sequence[int]] | None = None,
    output_token_ids: Sequence[Sequence[int]] | None = None,
    history_len: int | None = None,
    vocab_size: int | None = None,
) -> SamplingArrays[np.ndarray]:
    """Numpy SamplingArrays for `params[i]` in row i, padded to `batch_size` rows.

    seeds: each row's 64-bit stream seed (Sequence.seed); defaults to params.seed, which then
      must be set for every non-greedy row.
    prompt_token_ids / output_token_ids: needed when some row uses penalties.
    history_len: the static width H of the penalty history. None picks a power of two (>= 16)
      that fits, or no history at all when no row uses penalties; pass a fixed value to keep the
      compiled variants fixed.
    vocab_size: the width of the allowed-token bits (ceil(vocab_size / 32) words, all set); None
      gives width 1, which the sampler never applies.
    """
    rows = len(params)
    if rows > batch_size or len(num_generated) != rows:
        raise ValueError(f"{rows} params and {len(num_generated)} counts for batch_size={batch_size}")
    pad = batch_size - rows

    def col(values: Iterable[float], fill: float, dtype: type[np.generic]) -> np.ndarray:
        return np.asarray(list(values) + [fill] * pad, dtype=dtype)

    temps = [0.0 if p.is_greedy else p.temperature for p in params]
    if seeds is None:
        if any(p.seed is None and not p.is_greedy for p in params):
            raise ValueError("make_sampling_arrays: pass seeds= for rows without SamplingParams.seed")
        seeds = [p.seed or 0 for p in params]
    seed_words = [((s & 0xFFFFFFFF), (s >> 32) & 0xFFFFFFFF) for s in seeds]
    bias_ids, bias_values = _logit_bias(params, batch_size)
    return SamplingArrays(
        temperature=col(temps, 0.0, np.float32),
        top_k=col([max(p.top_k, 0) for p in params], 0, np.int32),
        top_p=col([p.top_p for p in params], 1.0, np.float32),
        min_p=col([p.min_p for p in params], 0.0, np.float32),
        repetition_penalty=col([p.repetition_penalty for p in params], 1.0, np.float32),
        presence_penalty=col([p.presence_penalty for p in params], 0.0, np.float32),
        frequency_penalty=col([p.frequency_penalty for p in params], 0.0, np.float32),
        seeds=np.asarray(seed_words + [(0, 0)] * pad, dtype=np.uint32).reshape(batch_size, 2),
        num_generated=col(num_generated, 0, np.int32),
        num_top_logprobs=col([p.logprobs or 0 for p in params], 0, np.int32),
        allowed=np.full((batch_size, allowed_width(vocab_size)), -1, np.int32),
        bias_ids=bias_ids,
        bias_values=bias_values,
        history=_penalty_history(params, prompt_token_ids, output_token_ids, batch_size, history_len),
    )


def allowed_width(vocab_size: int | None) -> int:
    """Words of allowed-token bits a row: ceil(vocab / 32); 1 (no masking) without a vocabulary."""
    return 1 if vocab_size is None else -(-vocab_size // 32)


def unsent_defaults(arrays: SamplingArrays[np.ndarray], grammar: bool) -> SamplingArrays[np.ndarray]:
    """The arrays less what is every row's default: `allowed` when no row has a grammar, the
    bias pair when no row has a logit bias (None; module docstring)."""
    biased = arrays.bias_ids is not None and bool((arrays.bias_ids[..., 0] >= 0).any())
    return dataclasses.replace(
        arrays,
        allowed=arrays.allowed if grammar else None,
        bias_ids=arrays.bias_ids if biased else None,
        bias_values=arrays.bias_values if biased else None,
    )


def is_plain(arrays: SamplingArrays[np.ndarray]) -> bool:
    """Whether every row (host arrays) samples greedily and asks for nothing else: no top
    logprobs, no logit bias, no grammar, no penalty (the bias pair and `allowed` unsent)."""
    return (
        arrays.history is None
        and arrays.allowed is None
        and arrays.bias_ids is None
        and bool(np.all(np.asarray(arrays.temperature) < GREEDY_EPS))
        and not np.any(np.asarray(arrays.num_top_logprobs))
    )


def fill_defaults[A: np.ndarray | jax.Array](
    arrays: SamplingArrays[A],
    vocab_size: int | None,
    full: Callable[[tuple[int, ...], int, type[np.generic]], A] = np.full,  # type: ignore[assignment]  # numpy's: A is np.ndarray
) -> SamplingArrays[A]:
    """`arrays` with each None default filled, shaped like its rows: allowed all set, no bias.
    `full(shape, value, dtype)` makes them (numpy; the compiled step passes its cached device arrays).
    Plain arrays stay as they are: their sampler reads neither."""
    if arrays.plain:
        return arrays
    if arrays.allowed is not None and arrays.bias_ids is not None:
        return arrays
    lead: tuple[int, ...] = arrays.temperature.shape  # [B], or [data, B]
    allowed, bias_ids, bias_values = arrays.allowed, arrays.bias_ids, arrays.bias_values
    if allowed is None:
        allowed = full((*lead, allowed_width(vocab_size)), -1, np.int32)
    if bias_ids is None:
        bias_ids = full((*lead, MAX_LOGIT_BIAS), -1, np.int32)
        bias_values = full((*lead, MAX_LOGIT_BIAS), 0, BIAS_DTYPE)
    return dataclasses.replace(arrays, allowed=allowed, bias_ids=bias_ids, bias_values=bias_values)


def sampling_arrays_for_sequences(
    seqs: Sequence[SequenceLike], batch_size: int, *, history_len: int | None = None, vocab_size: int | None = None
) -> SamplingArrays[np.ndarray]:
    """make_sampling_arrays for scheduler sequences, one row each (`allowed` all set: the caller
    fills the rows of sequences with a grammar)."""
    penalties = any(s.sampling_params.uses_penalties for s in seqs)
    return make_sampling_arrays(
        [s.sampling_params for s in seqs],
        [s.num_output_tokens for s in seqs],
        batch_size=batch_size,
        seeds=[s.seed for s in seqs],
        prompt_token_ids=[s.prompt_token_ids for s in seqs] if penalties else None,
        output_token_ids=[s.output_token_ids for s in seqs] if penalties else None,
        history_len=history_len,
        vocab_size=vocab_size,
    )


def _logit_bias(params: Sequence[SamplingParams], batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.full((batch_size, MAX_LOGIT_BIAS), -1, np.int32)
    values = np.zeros((batch_size, MAX_LOGIT_BIAS), BIAS_DTYPE)
    for row, p in enumerate(params):
        if isinstance(p.logit_bias, LogitBias) and p.logit_bias:  # SamplingParams made every bias one
            row_ids, row_values = p.logit_bias.columns
            ids[row, : len(row_ids)] = row_ids
            values[row, : len(row_ids)] = row_values
    return ids, values


def _penalty_history(
    params: Sequence[SamplingParams],
    prompts: Sequence[Sequence[int]] | None,
    outputs: Sequence[Sequence[int]] | None,
    batch_size: int,
    history_len: int | None,
) -> PenaltyHistory[np.ndarray] | None:
    if not any(p.uses_penalties for p in params):
        if history_len is None:
            return None
        return PenaltyHistory(np.full((batch_size, history_len), -1, np.int32), np.zeros(batch_size, np.int32))
    if outputs is None or (prompts is None and any(p.repetition_penalty != 1 for p in params)):
        raise ValueError("penalties need output_token_ids (and prompt_token_ids for repetition_penalty)")
    histories = []
    for i, p in enumerate(params):
        prompt = list(prompts[i]) if p.repetition_penalty != 1 and prompts is not None else []
        histories.append((prompt, list(outputs[i]) if p.uses_penalties else []))
    longest = max(len(a) + len(b) for a, b in histories)
    width = history_len if history_len is not None else max(16, 1 << (longest - 1).bit_length())
    if longest > width:
        raise ValueError(f"history_len={width} is shorter than a row's {longest} penalty tokens")
    token_ids = np.full((batch_size, width), -1, np.int32)
    num_prompt = np.zeros(batch_size, np.int32)
    for i, (prompt, output) in enumerate(histories):
        token_ids[i, : len(prompt) + len(output)] = prompt + output
        num_prompt[i] = len(prompt)
    return PenaltyHistory(token_ids, num_prompt)


def max_top_logprobs(params: Sequence[SamplingParams]) -> int:
    """The largest `logprobs` asked for in a batch (0 if none): a static argument of sample()."""
    return max((p.logprobs or 0 for p in params), default=0)
