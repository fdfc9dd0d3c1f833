"""Prompt logprobs inside the jitted step: how likely the model found each prompt token.

A step with `StepInputs.prompt` set (its own compiled variant) also scores rows of the batch
that belong to prompts whose request asked for them (SamplingParams.prompt_logprobs): row t's
logits predict the token after it, `targets[t]`; the result is that token's logprob under the
raw logits (as for sampled tokens: before penalties, bias, masks and temperature), its rank (1 +
the tokens with a higher logit) and, when some row asked for them, the N most likely tokens of
the row. Rows with target -1 are not read.

The LM head runs over every row of the bucket, `CHUNK` rows at a time (lax.map), so the [rows,
V] logits of one chunk are the most this holds at once, not [T, V].
"""

from __future__ import annotations

from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp

CHUNK = 256  # rows whose logits are materialized at once


@flax.struct.dataclass(frozen=True)  # as flax makes it; said for the type checker: `A` is covariant
class PromptInputs[A]:
    """`A`: the arrays' type, as in SamplingArrays (numpy on the host, jax.Array on the device)."""

    targets: A  # i32[T] the prompt token row t predicts; -1: no logprob wanted
    num_top: A  # i32[1] the most top logprobs a row asked for (0: none computed)


@flax.struct.dataclass
class PromptLogprobs:
    logprobs: jax.Array  # f32[T]    log_softmax(raw logits) of each row's target
    ranks: jax.Array  # i32[T]    1 + the tokens more likely than the target
    top_ids: jax.Array  # i32[T, N] the N most likely tokens of the row (N static)
    top_logprobs: jax.Array  # f32[T, N]


def prompt_logprobs(
    compute_logits: Callable[[jax.Array], jax.Array],
    hidden: jax.Array,
    inputs: PromptInputs[jax.Array],
    num_top_logprobs: int,
) -> PromptLogprobs:
    """hidden [T, E] (every row of the batch) -> the logprobs of `inputs.targets`; pure,
    `num_top_logprobs` static."""
    rows = hidden.shape[0]
    chunk = min(rows, CHUNK)
    pad = -rows % chunk
    hidden = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, chunk, hidden.shape[-1])
    targets = jnp.pad(inputs.targets, (0, pad), constant_values=-1).reshape(-1, chunk)
    want_top = inputs.num_top[0] > 0

    def score(args):
        h, target = args
        logits = compute_logits(h).astype(jnp.float32)  # [C, V]
        log_norm = jax.nn.logsumexp(logits, axis=-1)  # [C]
        chosen = jnp.take_along_axis(logits, jnp.maximum(target, 0)[:, None], axis=-1)[:, 0]
        rank = 1 + jnp.sum(logits > chosen[:, None], axis=-1, dtype=jnp.int32)

        def top(x):
            values, ids = jax.lax.top_k(x, num_top_logprobs)
            return values - log_norm[:, None], ids.astype(jnp.int32)

        top_lp, top_ids = jax.lax.cond(
            want_top,
            top,
            lambda x: (
                jnp.zeros((x.shape[0], num_top_logprobs), jnp.float32),
                jnp.zeros((x.shape[0], num_top_logprobs), jnp.int32),
            ),
            logits,
        )
        return chosen - log_norm, rank, top_ids, top_lp

    logprobs, ranks, top_ids, top_lp = jax.lax.map(score, (hidden, targets))
    return PromptLogprobs(
        logprobs.reshape(-1)[:rows],
        ranks.reshape(-1)[:rows],
        top_ids.reshape(-1, num_top_logprobs)[:rows],
        top_lp.reshape(-1, num_top_logprobs)[:rows],
    )
