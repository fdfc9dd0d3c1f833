"""The sampler that runs inside the jitted step: logits [B, V] + SamplingArrays -> tokens.

What `sample` does to one row (the order matters and the numpy reference in the tests mirrors it):
  1. logprobs: log_softmax of the raw logits (before penalties and temperature, like vLLM's
     default); the chosen token's logprob and the top-N are read from these, as the raw logit
     minus the row's logsumexp (no [B, V] array of logprobs is written).
  2. penalties (only when a history is given): repetition penalty over tokens seen in prompt or
     output (positive logits divided, negative multiplied), then frequency (times the output
     count) and presence (once per token seen in the output) subtracted.
  2b. logit bias: each row's biases (SamplingArrays.bias_ids / bias_values) are added to its
     logits, under a conditional taken only when some row has a bias.
  2c. structured output: tokens outside a row's allowed bits (SamplingArrays.allowed) are set to
     -inf, under a conditional taken only when some row has a grammar.
  3. greedy rows (temperature 0) take argmax of the penalized, biased and masked logits; nothing
     below affects them.
  4. temperature scaling, then top-k (ties with the k-th value kept), then top-p over what top-k
     left (the smallest set of tokens whose probability reaches top_p, ties with its last kept),
     then min-p (drop tokens whose probability is below min_p * the highest probability).
  5. one Gumbel-max draw per row with the key fold_in(fold_in(key(seed_lo), seed_hi),
     num_generated): the same sequence draws the same noise whatever batch or row it is in.

Penalty histories (arrays.PenaltyHistory) are scatter-added into a [B, V] count array here, on
the device. Nothing sorts the vocabulary: top-k and top-p find their thresholds by bisecting
the logits' order (`_top_k_top_p`), under a conditional taken only when some row samples with
them; the top-N logprobs (N static, the most any request may ask for, XLA's TopK) under one
taken only when some row asked for them; an all-greedy batch
without logprobs runs neither (tests/jaxinfer/test_step_hlo.py reads the compiled step).

Plain arrays (SamplingArrays.plain, static: its own compiled variant; the compiled step sets it where
it has compiled that variant and has checked every row is greedy with no top logprobs, logit
bias, grammar or penalty) take the argmax with no conditional at all. On XLA:GPU a conditional
copies its predicate to the host and waits for the device to reach it before the host launches
what follows, so the conditionals above would hold the host (and the next step's dispatch)
until the device had nearly run the step.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp

from jaxinfer.sampling.arrays import SamplingArrays
from jaxinfer.sampling.params import GREEDY_EPS
from jaxinfer.sampling.prompt_logprobs import PromptLogprobs


@flax.struct.dataclass
class SamplerOutput:
    tokens: jax.Array  # i32[B]
    logprobs: jax.Array  # f32[B]    log_softmax(raw logits) of the chosen token
    top_ids: jax.Array  # i32[B, N] the N most likely tokens (N = num_top_logprobs)
    top_logprobs: jax.Array  # f32[B, N]
    # Steps with prompt rows to score (prompt_logprobs.py): their logprobs [T, ...]; else None.
    prompt: PromptLogprobs | None = None


def sample(logits: jax.Array, arrays: SamplingArrays[jax.Array], num_top_logprobs: int = 0) -> SamplerOutput:
    """Samples one token per row of `logits` [B, V]. Pure; `num_top_logprobs` must be static."""
    logits = logits.astype(jnp.float32)
    raw = logits
    log_norm = jax.nn.logsumexp(raw, axis=-1)  # [B]: no [B, V] written
    if arrays.plain:
        return _greedy_only(raw, log_norm, num_top_logprobs)
    if arrays.history is not None:
        logits = apply_penalties(logits, arrays)
    if arrays.bias_ids is None or arrays.bias_values is None or arrays.allowed is None:
        raise ValueError("sample: the arrays' unsent defaults must be filled first (arrays.fill_defaults)")
    logits = apply_logit_bias(logits, arrays.bias_ids, arrays.bias_values)
    logits = apply_allowed(logits, arrays.allowed)
    greedy_tokens = jnp.argmax(logits, axis=-1)  # [B]
    is_greedy = arrays.temperature < GREEDY_EPS
    temperature = jnp.where(is_greedy, 1.0, arrays.temperature)

    def draw(scaled):  # masking and [B, V] of noise are paid only when some row samples
        masked = mask_logits(scaled, arrays.top_k, arrays.top_p, arrays.min_p)
        noise = jax.vmap(_gumbel, in_axes=(0, 0, None))(arrays.seeds, arrays.num_generated, scaled.shape[-1])  # [B, V]
        return jnp.argmax(masked + noise, axis=-1).astype(jnp.int32)  # [B]

    sampled_tokens = jax.lax.cond(
        jnp.all(is_greedy), lambda scaled: greedy_tokens.astype(jnp.int32), draw, logits / temperature[:, None]
    )
    tokens = jnp.where(is_greedy, greedy_tokens, sampled_tokens).astype(jnp.int32)
    chosen = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0] - log_norm

    def top(x):  # sorted by raw logit, the same order as by logprob
        values, ids = jax.lax.top_k(x, num_top_logprobs)
        return values - log_norm[:, None], ids

    top_logprobs, top_ids = jax.lax.cond(
        jnp.any(arrays.num_top_logprobs > 0),
        top,
        lambda x: (
            jnp.zeros((x.shape[0], num_top_logprobs), x.dtype),
            jnp.zeros((x.shape[0], num_top_logprobs), jnp.int32),
        ),
        raw,
    )  # [B, N] each
    return SamplerOutput(tokens, chosen, top_ids.astype(jnp.int32), top_logprobs)


def _greedy_only(raw: jax.Array, log_norm: jax.Array, num_top_logprobs: int) -> SamplerOutput:
    """What `sample` returns for plain arrays (every row greedy, nothing else asked: no
    conditional at all): the argmax and its logprob, the top-N zeros as when none was asked."""
    tokens = jnp.argmax(raw, axis=-1).astype(jnp.int32)
    chosen = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0] - log_norm
    batch = raw.shape[0]
    return SamplerOutput(
        tokens, chosen, jnp.zeros((batch, num_top_logprobs), jnp.int32), jnp.zeros((batch, num_top_logprobs), raw.dtype)
    )


def _gumbel(seed: jax.Array, num_generated: jax.Array, vocab_size: int) -> jax.Array:
    key = jax.random.fold_in(jax.random.key(seed[0]), seed[1])
    key = jax.random.fold_in(key, num_generated)
    return jax.random.gumbel(key, (vocab_size,), jnp.float32)  # [V]


def apply_penalties(logits: jax.Array, arrays: SamplingArrays[jax.Array]) -> jax.Array:
    """Repetition penalty over prompt + output ids, then frequency and presence over outputs."""
    if arrays.history is None:
        raise ValueError("apply_penalties: the arrays carry no penalty history (no row uses penalties)")
    batch, vocab = logits.shape
    ids = arrays.history.token_ids  # [B, H]
    ids = jnp.where(ids >= 0, ids, vocab)  # an out-of-range id: the scatters drop it
    is_output = jnp.arange(ids.shape[1])[None, :] >= arrays.history.num_prompt[:, None]  # [B, H]
    rows = jnp.arange(batch)[:, None]
    output_counts = (
        jnp.zeros((batch, vocab), jnp.float32).at[rows, ids].add(is_output.astype(jnp.float32), mode="drop")
    )  # [B, V]
    seen = jnp.zeros((batch, vocab), bool).at[rows, ids].set(True, mode="drop")  # [B, V]
    rep = arrays.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - arrays.frequency_penalty[:, None] * output_counts
    return logits - arrays.presence_penalty[:, None] * (output_counts > 0)


def apply_logit_bias(logits: jax.Array, bias_ids: jax.Array, bias_values: jax.Array) -> jax.Array:
    """Adds bias_values [B, L] to the logits of bias_ids [B, L] (packed at the front of each row,
    -1 pads); the [B, V] scatter runs only when some row has a bias (its first id is set)."""
    batch, vocab = logits.shape

    def add(x):
        ids = jnp.where(bias_ids >= 0, bias_ids, vocab)  # pads (and ids past V): the scatter drops them
        return x.at[jnp.arange(batch)[:, None], ids].add(bias_values.astype(x.dtype), mode="drop")

    return jax.lax.cond(jnp.any(bias_ids[:, 0] >= 0), add, lambda x: x, logits)


def apply_allowed(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """-inf outside each row's allowed-token bits [B, W]; a no-op (statically) when W * 32 cannot
    cover the vocabulary, and (at run time) when every bit is set."""
    batch, vocab = logits.shape
    if allowed.shape[-1] * 32 < vocab:
        return logits

    def mask(x):
        bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
        return jnp.where(bits.reshape(batch, -1)[:, :vocab] != 0, x, -jnp.inf)

    return jax.lax.cond(jnp.any(allowed != -1), mask, lambda x: x, logits)


def mask_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """Sets tokens outside top-k, then top-p, then min-p to -inf (temperature already applied)."""
    vocab = logits.shape[-1]
    needs_mask = jnp.any(((top_k > 0) & (top_k < vocab)) | (top_p < 1.0))
    logits = jax.lax.cond(needs_mask, _top_k_top_p, lambda x, k, p: x, logits, top_k, top_p)
    top = jnp.max(logits, axis=-1, keepdims=True)  # [B, 1]
    # p_i >= min_p * p_max  <=>  logit_i - max >= log(min_p); min_p = 0 keeps everything
    keep = logits - top >= jnp.log(min_p)[:, None]
    return jnp.where(keep, logits, -jnp.inf)


_SEARCH_STEPS = 32  # halvings that take a range of 2^32 keys to one


def _order_keys(x: jax.Array) -> jax.Array:
    """float32 -> uint32 keys in the floats' order (-inf lowest, -0.0 and 0.0 one key; no NaN)."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _search(lo: jax.Array, hi: jax.Array, holds: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """The largest key t in [lo, hi] ([B, 1] each) where `holds(t)` ([B, 1] bool; true up to
    some key, false past it), or lo where it holds nowhere: a bisection, no sort."""

    def step(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2 + ((hi - lo) & 1)  # the upper middle, without overflow
        ok = holds(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok | (lo == hi), hi, mid - 1)

    return jax.lax.fori_loop(0, _SEARCH_STEPS, step, (lo, hi))[0]


def _top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Keeps the logits at or above the k-th largest, then those at or above the top-p
    threshold: the highest logit whose tokens at or above it hold at least top_p of the
    probability top-k left (the smallest such set, ties with its last kept). Both thresholds are
    found by bisecting the logits' order keys, 2 x 32 passes of compare-and-sum over [B, V]: no
    sort of the vocabulary, which XLA:TPU compiles for ~10 s in every step variant."""
    vocab = logits.shape[-1]
    keys = _order_keys(logits)  # [B, V]
    lowest, highest = keys.min(axis=-1, keepdims=True), keys.max(axis=-1, keepdims=True)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)[:, None]  # [B, 1]
    kth = _search(lowest, highest, lambda t: jnp.sum(keys >= t, axis=-1, keepdims=True) >= k)
    probs = jax.nn.softmax(jnp.where(keys >= kth, logits, -jnp.inf), axis=-1)  # [B, V]
    p = top_p[:, None]
    pth = _search(lowest, highest, lambda t: jnp.sum(jnp.where(keys >= t, probs, 0.0), axis=-1, keepdims=True) >= p)
    pth = jnp.where(p >= 1.0, lowest, pth)
    return jnp.where(keys >= jnp.maximum(kth, pth), logits, -jnp.inf)
