"""A mixture of experts' MLP: routing, then each token's top-k expert MLPs summed by weight.

Experts are stacked (w_gate_up [X, E, 2, F], w_down [X, F, E]). Two forms compute the same sum:
"ragged": the token-choice rows sorted by expert and run as grouped matmuls (`lax.ragged_dot`),
k/X of the dense work; "dense": every expert on every token, weighted by a [T, X] matrix that is
zero off the top k (on the CPU ragged_dot lowers to about that dense work plus masking and
measured ~2x slower, so "auto" is dense there). Under a mesh with an `expert` or `tensor` axis
each device runs the form on its own experts and MLP columns (sharding/experts.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from sharding.experts import shard_experts


def route(x: jax.Array, router: jax.Array, top_k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """x [T, E], router [E, X] -> (weights [T, k] in x's dtype, expert ids i32[T, k]): softmax over
    all X router logits in float32, the top k kept, renormalised to sum to 1 if asked (Mixtral
    always: the same as a softmax over the top-k logits; Qwen3-MoE per norm_topk_prob)."""
    logits = jnp.einsum("te,ex->tx", x.astype(jnp.float32), router.astype(jnp.float32))  # [T, X]
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)  # [T, k] each
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(x.dtype), experts


def moe_mlp(x: jax.Array, router: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, *, top_k: int,
            renormalize: bool, impl: str = "auto") -> jax.Array:
    """x [T, E] -> [T, E]: each token's top-k experts' gated MLPs summed with the router's weights."""
    weights, experts = route(x, router, top_k, renormalize)
    if impl == "auto":
        impl = "dense" if jax.default_backend() == "cpu" else "ragged"
    if impl not in _FORMS:
        raise ValueError(f"unknown MoE impl {impl!r}; known: 'auto', 'dense', 'ragged'")
    return shard_experts(_FORMS[impl], x, weights, experts, w_gate_up, w_down)


def dense_experts(x, weights, experts, w_gate_up, w_down) -> jax.Array:
    """Every expert on every token; an id past the last expert (another shard's) selects none."""
    combine = jnp.einsum("tkx,tk->tx", jax.nn.one_hot(experts, w_gate_up.shape[0], dtype=x.dtype), weights)
    gate_up = jnp.einsum("te,xecf->txcf", x, w_gate_up)  # [T, X, 2, F]
    hidden = jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1]  # [T, X, F]
    return jnp.einsum("txf,xfe,tx->te", hidden, w_down, combine)


def ragged_experts(x, weights, experts, w_gate_up, w_down) -> jax.Array:
    """Rows sorted by expert, grouped matmuls; rows for an id past the last expert (another
    shard's) sort last, outside every group, and add nothing."""
    (t, top_k), num_experts = experts.shape, w_gate_up.shape[0]
    flat = experts.reshape(-1)  # [T*k]: row j is token j // k's (j % k)-th choice
    order = jnp.argsort(flat, stable=True)  # rows grouped by expert
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [X]
    xs = x[order // top_k]  # [T*k, E]
    gate = jax.lax.ragged_dot(xs, w_gate_up[:, :, 0], group_sizes)  # [T*k, F]
    up = jax.lax.ragged_dot(xs, w_gate_up[:, :, 1], group_sizes)
    out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down, group_sizes)  # [T*k, E], sorted
    out = jnp.where((flat[order] < num_experts)[:, None], out, 0)  # rows in no group: undefined
    out = jnp.zeros_like(out).at[order].set(out).reshape(t, top_k, -1)  # back to token order
    return jnp.einsum("tke,tk->te", out, weights)


_FORMS = {"dense": dense_experts, "ragged": ragged_experts}
