"""Sampling: user-facing `SamplingParams` and the sampler that runs inside the jitted step.

Host to device:

    SamplingParams (one per request, validated here, at the API boundary)
      --make_sampling_arrays(params, num_generated, seeds, histories, batch_size)-->
        (or sampling_arrays_for_sequences(scheduler sequences, batch_size))
    SamplingArrays (numpy, one row per sequence, padded to the batch bucket)
      --the jitted step--> sample(logits [B, V], arrays) -> SamplerOutput (tokens, logprobs)

Every per-request option is an array row, so a new mix of options never recompiles; only the
batch bucket, the penalty-history width (or its absence) and `num_top_logprobs` are static.

What `sample` does to one row (the order matters and the numpy reference in the tests mirrors it):
  1. logprobs: log_softmax of the raw logits (before penalties and temperature, like vLLM's
     default); the chosen token's logprob and the top-N are read from these.
  2. penalties (only when a history is given): repetition penalty over tokens seen in prompt or
     output (positive logits divided, negative multiplied), then frequency (times the output
     count) and presence (once per token seen in the output) subtracted.
  3. greedy rows (temperature 0) take argmax of the penalized logits; nothing below affects them.
  4. temperature scaling, then top-k (ties with the k-th value kept), then top-p over what top-k
     left (the smallest set of tokens whose probability reaches top_p, ties with its last kept),
     then min-p (drop tokens whose probability is below min_p * the highest probability).
  5. one Gumbel-max draw per row with the key fold_in(fold_in(key(seed_lo), seed_hi),
     num_generated): the same sequence draws the same noise whatever batch or row it is in.

Penalty histories: a row's prompt ids (only when its repetition penalty is on) then its output
ids, padded with -1 to a width H, are scatter-added into a [B, V] count array inside the jit. The
transfer is B*H int32 per step instead of B*V; the [B, V] counts exist on the device only.
When no row of a batch uses penalties the history is None (a separate compiled variant) and the
step pays nothing.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from jaxinfer.sequence import Sequence as SequenceLike

MAX_LOGPROBS = 20
GREEDY_EPS = 1e-5  # temperatures below this sample greedily (dividing by them overflows)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


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

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop_token_ids is None:
            object.__setattr__(self, "stop_token_ids", ())
        else:
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        def bad(name, why):
            raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        if not _is_int(self.n) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not _is_number(self.temperature) or not self.temperature >= 0 \
                or math.isinf(self.temperature):
            bad("temperature", "must be a finite number >= 0 (0 = greedy)")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "must be -1 or 0 (off) or an integer >= 1")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            bad("repetition_penalty", "must be a finite number > 0 (1 = off)")
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

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


# --- device side ----------------------------------------------------------------------------------
@flax.struct.dataclass
class PenaltyHistory:
    token_ids: jax.Array   # i32[B, H] prompt ids (if the row's repetition penalty is on), then
                           # output ids; -1 pads
    num_prompt: jax.Array  # i32[B]    how many leading ids of the row are prompt ids


@flax.struct.dataclass
class SamplingArrays:
    """One row per sequence of the batch; padding rows are greedy with every filter off."""
    temperature: jax.Array         # f32[B] 0 = greedy
    top_k: jax.Array               # i32[B] 0 = off
    top_p: jax.Array               # f32[B] 1 = off
    min_p: jax.Array               # f32[B] 0 = off
    repetition_penalty: jax.Array  # f32[B] 1 = off
    presence_penalty: jax.Array    # f32[B] 0 = off
    frequency_penalty: jax.Array   # f32[B] 0 = off
    seeds: jax.Array               # u32[B, 2] the sequence's 64-bit seed as (low, high) words
    num_generated: jax.Array       # i32[B] output tokens so far: which draw of the stream this is
    history: PenaltyHistory | None = None  # None: no row uses penalties (static structure)


@flax.struct.dataclass
class SamplerOutput:
    tokens: jax.Array        # i32[B]
    logprobs: jax.Array      # f32[B]    log_softmax(raw logits) of the chosen token
    top_ids: jax.Array       # i32[B, N] the N most likely tokens (N = num_top_logprobs)
    top_logprobs: jax.Array  # f32[B, N]


def sample(logits: jax.Array, arrays: SamplingArrays, num_top_logprobs: int = 0) -> SamplerOutput:
    """Samples one token per row of `logits` [B, V]. Pure; `num_top_logprobs` must be static."""
    logits = logits.astype(jnp.float32)
    logprobs = jax.nn.log_softmax(logits, axis=-1)                        # [B, V]
    if arrays.history is not None:
        logits = apply_penalties(logits, arrays)
    greedy_tokens = jnp.argmax(logits, axis=-1)                           # [B]
    is_greedy = arrays.temperature < GREEDY_EPS
    temperature = jnp.where(is_greedy, 1.0, arrays.temperature)

    def draw(scaled):  # masking and [B, V] of noise are paid only when some row samples
        masked = mask_logits(scaled, arrays.top_k, arrays.top_p, arrays.min_p)
        noise = jax.vmap(_gumbel, in_axes=(0, 0, None))(arrays.seeds, arrays.num_generated,
                                                         scaled.shape[-1])  # [B, V]
        return jnp.argmax(masked + noise, axis=-1).astype(jnp.int32)      # [B]

    sampled_tokens = jax.lax.cond(
        jnp.all(is_greedy), lambda scaled: greedy_tokens.astype(jnp.int32), draw,
        logits / temperature[:, None])
    tokens = jnp.where(is_greedy, greedy_tokens, sampled_tokens).astype(jnp.int32)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    top_logprobs, top_ids = jax.lax.top_k(logprobs, num_top_logprobs)     # [B, N]
    return SamplerOutput(tokens, chosen, top_ids.astype(jnp.int32), top_logprobs)


def _gumbel(seed: jax.Array, num_generated: jax.Array, vocab_size: int) -> jax.Array:
    key = jax.random.fold_in(jax.random.key(seed[0]), seed[1])
    key = jax.random.fold_in(key, num_generated)
    return jax.random.gumbel(key, (vocab_size,), jnp.float32)             # [V]


def apply_penalties(logits: jax.Array, arrays: SamplingArrays) -> jax.Array:
    """Repetition penalty over prompt + output ids, then frequency and presence over outputs."""
    batch, vocab = logits.shape
    ids = arrays.history.token_ids                                        # [B, H]
    ids = jnp.where(ids >= 0, ids, vocab)  # an out-of-range id: the scatters drop it
    is_output = jnp.arange(ids.shape[1])[None, :] >= arrays.history.num_prompt[:, None]  # [B, H]
    rows = jnp.arange(batch)[:, None]
    output_counts = jnp.zeros((batch, vocab), jnp.float32).at[rows, ids].add(
        is_output.astype(jnp.float32), mode="drop")                       # [B, V]
    seen = jnp.zeros((batch, vocab), bool).at[rows, ids].set(True, mode="drop")  # [B, V]
    rep = arrays.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - arrays.frequency_penalty[:, None] * output_counts
    return logits - arrays.presence_penalty[:, None] * (output_counts > 0)


def mask_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array,
                min_p: jax.Array) -> jax.Array:
    """Sets tokens outside top-k, then top-p, then min-p to -inf (temperature already applied)."""
    vocab = logits.shape[-1]
    needs_sort = jnp.any(((top_k > 0) & (top_k < vocab)) | (top_p < 1.0))
    logits = jax.lax.cond(needs_sort, _top_k_top_p, lambda x, k, p: x, logits, top_k, top_p)
    top = jnp.max(logits, axis=-1, keepdims=True)                         # [B, 1]
    # p_i >= min_p * p_max  <=>  logit_i - max >= log(min_p); min_p = 0 keeps everything
    keep = logits - top >= jnp.log(min_p)[:, None]
    return jnp.where(keep, logits, -jnp.inf)


def _top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    vocab = logits.shape[-1]
    sorted_logits = -jnp.sort(-logits, axis=-1)                           # [B, V] descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_logits, k[:, None] - 1, axis=-1)     # [B, 1]
    sorted_logits = jnp.where(sorted_logits >= kth, sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(sorted_logits, axis=-1)                        # [B, V]
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)       # a prefix of the sort
    num_keep = jnp.sum(keep, axis=-1, keepdims=True)                      # [B, 1] >= 1
    pth = jnp.take_along_axis(sorted_logits, num_keep - 1, axis=-1)       # [B, 1]
    return jnp.where(logits >= jnp.maximum(kth, pth), logits, -jnp.inf)


# --- host side: params -> arrays ------------------------------------------------------------------
def make_sampling_arrays(params: Sequence[SamplingParams], num_generated: Sequence[int], *,
                         batch_size: int, seeds: Sequence[int] | None = None,
                         prompt_token_ids: Sequence[Sequence[int]] | None = None,
                         output_token_ids: Sequence[Sequence[int]] | None = None,
                         history_len: int | None = None) -> SamplingArrays:
    """Numpy SamplingArrays for `params[i]` in row i, padded to `batch_size` rows.

    seeds: each row's 64-bit stream seed (Sequence.seed); defaults to params.seed, which then
      must be set for every non-greedy row.
    prompt_token_ids / output_token_ids: needed when some row uses penalties.
    history_len: the static width H of the penalty history. None picks a power of two (>= 16)
      that fits, or no history at all when no row uses penalties; pass a fixed value to keep the
      compiled variants fixed.
    """
    rows = len(params)
    if rows > batch_size or len(num_generated) != rows:
        raise ValueError(f"{rows} params and {len(num_generated)} counts for "
                         f"batch_size={batch_size}")
    pad = batch_size - rows

    def col(values, fill, dtype):
        return np.asarray(list(values) + [fill] * pad, dtype=dtype)

    temps = [0.0 if p.is_greedy else p.temperature for p in params]
    if seeds is None:
        if any(p.seed is None and not p.is_greedy for p in params):
            raise ValueError("make_sampling_arrays: pass seeds= for rows without "
                             "SamplingParams.seed")
        seeds = [p.seed or 0 for p in params]
    seed_words = [((s & 0xFFFFFFFF), (s >> 32) & 0xFFFFFFFF) for s in seeds]
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
        history=_penalty_history(params, prompt_token_ids, output_token_ids, batch_size,
                                 history_len))


def sampling_arrays_for_sequences(seqs: Sequence["SequenceLike"], batch_size: int, *,
                                  history_len: int | None = None) -> SamplingArrays:
    """make_sampling_arrays for scheduler Sequences (jaxinfer.sequence), one row each."""
    penalties = any(s.sampling_params.uses_penalties for s in seqs)
    return make_sampling_arrays(
        [s.sampling_params for s in seqs], [s.num_output_tokens for s in seqs],
        batch_size=batch_size, seeds=[s.seed for s in seqs],
        prompt_token_ids=[s.prompt_token_ids for s in seqs] if penalties else None,
        output_token_ids=[s.output_token_ids for s in seqs] if penalties else None,
        history_len=history_len)


def _penalty_history(params, prompts, outputs, batch_size, history_len) -> PenaltyHistory | None:
    if not any(p.uses_penalties for p in params):
        if history_len is None:
            return None
        return PenaltyHistory(np.full((batch_size, history_len), -1, np.int32),
                              np.zeros(batch_size, np.int32))
    if outputs is None or (prompts is None and any(p.repetition_penalty != 1 for p in params)):
        raise ValueError("penalties need output_token_ids (and prompt_token_ids for "
                         "repetition_penalty)")
    histories = []
    for i, p in enumerate(params):
        prompt = list(prompts[i]) if p.repetition_penalty != 1 else []
        histories.append((prompt, list(outputs[i]) if p.uses_penalties else []))
    longest = max(len(a) + len(b) for a, b in histories)
    width = history_len if history_len is not None else max(16, 1 << (longest - 1).bit_length())
    if longest > width:
        raise ValueError(f"history_len={width} is shorter than a row's {longest} penalty tokens")
    token_ids = np.full((batch_size, width), -1, np.int32)
    num_prompt = np.zeros(batch_size, np.int32)
    for i, (prompt, output) in enumerate(histories):
        token_ids[i, :len(prompt) + len(output)] = prompt + output
        num_prompt[i] = len(prompt)
    return PenaltyHistory(token_ids, num_prompt)


def max_top_logprobs(params: Sequence[SamplingParams]) -> int:
    """The largest `logprobs` asked for in a batch (0 if none): a static argument of sample()."""
    return max((p.logprobs or 0 for p in params), default=0)
