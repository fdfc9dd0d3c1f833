"""Verifying draft tokens inside the jitted step (speculative decoding, Leviathan et al. 2023).

A speculating sequence is scheduled with its k draft tokens after its last known token: k + 1
query positions, whose logits [S*(K+1), V] come here (K = the static draft width; a row with fewer
drafts repeats its last position, ignored). Two rules:

`verify` (the engine's, for deterministic proposers: n-gram lookup and greedy draft models, whose
q is one-hot on the draft token x). The standard rule then accepts x with probability
min(1, p(x) / 1) = p(x) and, on rejection, samples from normalize(max(0, p - onehot(x))), which is
p conditioned on "not x". Both are what one draw t ~ p gives when x is accepted iff t == x, and t
is emitted either way. So every position j of a row is sampled exactly as the plain sampler would
sample that token (same processing, same random stream: the sequence's seed and the token's index
num_generated + j), and a row keeps the leading drafts equal to those samples plus the first
sample that differs (or the bonus token after all k). Greedy and seeded outputs are therefore
token-identical to non-speculative decoding, and logprobs of accepted tokens are the target's.

`rejection_sample` (the general rule, for proposers that sample from a distribution q: accept x
with probability min(1, p(x)/q(x)), else sample from normalize(max(0, p - q)); after k accepted
drafts a bonus token from p). It takes explicit probabilities; tests check its output
distribution against p by chi-square.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxinfer.sampling.arrays import SamplingArrays
from jaxinfer.sampling.sampler import SamplerOutput, sample


@flax.struct.dataclass(frozen=True)  # as flax makes it; said for the type checker: `A` is covariant
class SpecInputs[A]:
    """The draft tokens of a verify step, one row per sequence slot. `A`: the arrays' type, as in
    SamplingArrays (numpy on the host, jax.Array on the device)."""

    draft_ids: A  # i32[S, K] each row's drafts, packed at the front; -1 pads
    num_drafts: A  # i32[S]    0: an ordinary row (a plain decode or a prefill chunk)


@flax.struct.dataclass
class VerifyOutput:
    sampled: SamplerOutput  # [S, K+1, ...] the target's token (and logprobs) at each position
    num_accepted: jax.Array  # i32[S] leading drafts equal to the target's tokens: the row emits
    # sampled.tokens[:, :num_accepted + 1]


def expand_rows(arrays: SamplingArrays[jax.Array], width: int) -> SamplingArrays[jax.Array]:
    """Each row repeated for `width` positions; position j draws the (num_generated + j)-th
    number of the row's random stream, as the plain sampler would for that token."""
    repeated = jax.tree.map(lambda a: jnp.repeat(a, width, axis=0), arrays)
    offsets = jnp.tile(jnp.arange(width, dtype=jnp.int32), arrays.num_generated.shape[0])
    return repeated.replace(num_generated=repeated.num_generated + offsets)


def verify(
    logits: jax.Array, arrays: SamplingArrays[jax.Array], spec: SpecInputs[jax.Array], num_top_logprobs: int = 0
) -> VerifyOutput:
    """logits [S*(K+1), V] (row r's positions back to back), arrays [S]: the coupled rule above."""
    rows, k = spec.draft_ids.shape
    out = sample(logits, expand_rows(arrays, k + 1), num_top_logprobs)  # [S*(K+1)]
    out = jax.tree.map(lambda a: a.reshape(rows, k + 1, *a.shape[1:]), out)
    live = jnp.arange(k)[None, :] < spec.num_drafts[:, None]  # [S, K]
    match = (out.tokens[:, :k] == spec.draft_ids) & live
    num_accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)
    return VerifyOutput(out, num_accepted.astype(jnp.int32))


def last_tokens(out: VerifyOutput) -> jax.Array:
    """i32[S]: each row's last emitted token (the bonus or correction token)."""
    return jnp.take_along_axis(out.sampled.tokens, out.num_accepted[:, None], axis=1)[:, 0]


def rejection_sample(
    target_probs: jax.Array, draft_probs: jax.Array, draft_ids: jax.Array, num_drafts: jax.Array, key: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The standard rule. target_probs [B, K+1, V] (p at each position), draft_probs [B, K, V]
    (the q each draft was drawn from), draft_ids [B, K], num_drafts [B], key: a typed PRNG key.
    Returns (tokens i32[B, K+1], num_accepted i32[B]): tokens[:, :num_accepted] are the accepted
    drafts and tokens[:, num_accepted] the correction (or bonus) token; later entries are -1."""
    batch, k = draft_ids.shape
    key_u, key_x = jax.random.split(key)
    u = jax.random.uniform(key_u, (batch, k))  # [B, K]
    ids = jnp.maximum(draft_ids, 0)[..., None]
    p_x = jnp.take_along_axis(target_probs[:, :k], ids, axis=-1)[..., 0]  # [B, K]
    q_x = jnp.take_along_axis(draft_probs, ids, axis=-1)[..., 0]  # [B, K]
    live = jnp.arange(k)[None, :] < num_drafts[:, None]
    accept = (u * q_x < p_x) & live  # u < p(x) / q(x)
    num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)  # [B]
    rows = jnp.arange(batch)
    p_stop = target_probs[rows, num_accepted]  # [B, V]
    rejected = (num_accepted < num_drafts)[:, None]
    q_stop = jnp.where(rejected, draft_probs[rows, jnp.minimum(num_accepted, k - 1)], 0.0)
    residual = jnp.maximum(p_stop - q_stop, 0.0)
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_stop)  # p == q: any
    x = jax.random.categorical(key_x, jnp.log(residual), axis=-1).astype(jnp.int32)  # [B]
    pos = jnp.arange(k + 1)[None, :]
    padded = jnp.concatenate([draft_ids, jnp.full((batch, 1), -1, draft_ids.dtype)], axis=1)
    tokens = jnp.where(pos < num_accepted[:, None], padded, jnp.where(pos == num_accepted[:, None], x[:, None], -1))
    return tokens.astype(jnp.int32), num_accepted.astype(jnp.int32)
