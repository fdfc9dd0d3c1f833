"""A mixture's expert MLPs per shard, under `jax.shard_map` over the current mesh (expert parallelism).

Experts are stacked ([X, E, 2, F] and [X, F, E]) and split over the mesh axis `expert` (each of
its `ep` devices holds X/ep whole experts) and, inside each expert, the MLP width F over
`tensor`. Every device of an expert group sees every token of the step (the step's tokens are
replicated over `expert`; with context parallelism they stay split over `sequence`), so no token
is sent anywhere before the experts run: each device routes on the whole router (computed
before this call), keeps the choices that fall on its own experts, runs its experts' partial MLP
(its F/tp columns) on just those tokens, and one all-reduce over `expert` and `tensor` sums
the pieces. The all-reduce carries the [T, E] output once per MoE layer, the same traffic as the
tensor-parallel all-reduce a dense MLP already has, and it replaces the all-to-all dispatch and
combine pair that splitting tokens between expert groups would need.

    out = shard_experts(local, x, weights, experts, w_gate_up, w_down)

`local(x, weights, experts, w_gate_up, w_down) -> [T, E]` is the one-device computation over the
experts it is given; `experts` holds local expert ids, and `n_local` (one past the last) marks a
choice made for another device's expert, whose weight is 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sharding.mesh import EXPERT, SEQUENCE, TENSOR, AnyMesh, axis_size, current_mesh

# (x [T, E], weights [T, k], experts [T, k] local ids, w_gate_up [X', E, 2, F'], w_down [X', F', E])
# -> [T, E]: the experts' weighted sum on one device.
LocalExperts = Callable[..., jax.Array]


class ExpertWeight(Protocol):
    """A stacked experts' weight [X, ...]: a plain array, or a pytree of arrays (a quantized
    weight's integers and scales) that says the shape of the float weight it stands for."""

    @property
    def shape(self) -> tuple[int, ...]: ...


def check_expert_axis(mesh: AnyMesh | None, num_experts: int) -> None:
    """ValueError unless the mesh's `expert` axis (if > 1) divides the model's expert count."""
    ep = axis_size(mesh, EXPERT)
    if ep > 1 and (num_experts == 0 or num_experts % ep):
        what = "a model without experts" if num_experts == 0 else f"{num_experts} experts"
        raise ValueError(
            f"mesh axis expert={ep} cannot split {what}; use an expert axis that divides "
            "the expert count (mixture-of-experts models only), or none"
        )


def own_choices(
    experts: jax.Array, weights: jax.Array, first: jax.Array | int, n_local: int
) -> tuple[jax.Array, jax.Array]:
    """Global expert ids -> ids local to the shard holding experts [first, first + n_local);
    choices of other shards' experts become id `n_local` with weight 0."""
    local = experts - first
    mine = (local >= 0) & (local < n_local)
    return jnp.where(mine, local, n_local).astype(experts.dtype), jnp.where(mine, weights, 0)


def _specs(weight: ExpertWeight, axes: tuple[str | None, ...]) -> Any:
    """The PartitionSpec of each array of a weight (a plain array, or a quantized weight's pytree
    of integers and scales of the weight's rank): an axis of size 1 (a per-channel scale's input
    axis) is not split."""
    return jax.tree.map(lambda a: P(*(None if n == 1 else axis for n, axis in zip(a.shape, axes))), weight)


def shard_experts(
    local: LocalExperts,
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    w_gate_up: ExpertWeight,
    w_down: ExpertWeight,
) -> jax.Array:
    """The experts' weighted sum [T, E] for routed tokens; without a mesh (or with neither an
    expert nor a tensor split) this is `local` itself."""
    mesh = current_mesh()
    ep, tp = axis_size(mesh, EXPERT), axis_size(mesh, TENSOR)
    if mesh is None or ep == tp == 1:
        return local(x, weights, experts, w_gate_up, w_down)
    num_experts = w_gate_up.shape[0]
    if num_experts % ep:
        raise ValueError(
            f"{num_experts} experts cannot be split over expert={ep} devices; choose an "
            "expert axis size that divides the expert count"
        )
    split = EXPERT if ep > 1 else None
    cols = TENSOR if tp > 1 else None
    tok = P(SEQUENCE if axis_size(mesh, SEQUENCE) > 1 else None, None)
    reduce_over = tuple(a for a in (split, cols) if a is not None)

    def per_shard(
        x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate_up: ExpertWeight, w_down: ExpertWeight
    ) -> jax.Array:
        n_local = w_gate_up.shape[0]
        first = jax.lax.axis_index(EXPERT) * n_local if split else 0
        experts, weights = own_choices(experts, weights, first, n_local)
        return jax.lax.psum(local(x, weights, experts, w_gate_up, w_down), reduce_over)

    return jax.shard_map(
        per_shard,
        in_specs=(tok, tok, tok, _specs(w_gate_up, (split, None, None, cols)), _specs(w_down, (split, cols, None))),
        out_specs=tok,
        check_vma=False,
    )(x, weights, experts, w_gate_up, w_down)
