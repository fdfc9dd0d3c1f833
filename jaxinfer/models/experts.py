"""A mixture of experts' MLP: routing, then each token's top-k expert MLPs summed by weight.

Experts are held in one of two layouts, and each has its forms:
- **stacked** (w_gate_up [X, E, 2, F], w_down [X, F, E]; the checkpoint layout, and the one
  sharded over the `expert` and `tensor` mesh axes by sharding/experts.py):
  "ragged": the token-choice rows sorted by expert and run as grouped matmuls (`lax.ragged_dot`),
  k/X of the dense work where the compiler has a grouped matmul (TPU); "dense": every expert on
  every token as one batched matmul over X, weighted by a [X, T] matrix that is zero off the top
  k (the CPU, where ragged_dot lowers to the dense work plus masking and measured ~2x slower);
  "capacity": each expert once, on its chosen tokens packed into C rows, one batched matmul over
  the experts (GPUs, where XLA also computes ragged_dot densely: every row times every expert,
  X times the work; see `capacity_experts`).
- **per expert** (tuples of X arrays [E, 2, F] and [F, E], made by `quant.unstack` for one CPU device):
  only the chosen experts' weights are read. XLA copies any slice of a stacked array before a
  matmul, which made reading k of X stacked experts cost more than reading all X; whole arrays
  are handed to a conditional without a copy. Under 64 tokens a loop over the token-expert
  choices, sorted by expert (an expert chosen twice in a row is read from cache), runs each
  one's expert under a `lax.switch` on its one row; from 64 tokens (and for quantized experts at
  any count) each expert runs once, under a conditional taken only when some token chose it, on
  its tokens packed into the fewest of T/8, T/4, T/2 or T rows.

Any expert weight may be quantized (jaxinfer.quant, inputs on E for gate|up and on F for down):
the per-expert and dense forms multiply through the linear layers' `einsum`; the grouped
matmuls take per-channel int8 integers and scale each row by its expert's scales, and dequantize
other layouts first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxinfer.models.layers import gated_mlp
from jaxinfer.quant import QuantizedWeight, dequantize, einsum
from jaxinfer.quant.activations import fake_quantized
from pallas_kernels import target_backend
from pallas_kernels.common import next_pow2
from sharding.experts import shard_experts

Stacked = jax.Array | QuantizedWeight  # the experts stacked: [X, ...], maybe quantized
Experts = Stacked | tuple[Stacked, ...]  # stacked, or one weight per expert
# A stacked form: (x [T, E], weights [T, k], experts i32[T, k], w_gate_up, w_down) -> [T, E].
Form = Callable[[jax.Array, jax.Array, jax.Array, Stacked, Stacked], jax.Array]


def route(x: jax.Array, router: jax.Array, top_k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """x [T, E], router [E, X] -> (weights [T, k] in x's dtype, expert ids i32[T, k]): softmax over
    all X router logits in float32, the top k kept, renormalised to sum to 1 if asked (Mixtral
    always: the same as a softmax over the top-k logits; Qwen3-MoE per norm_topk_prob)."""
    logits = jnp.einsum("te,ex->tx", x.astype(jnp.float32), router.astype(jnp.float32))  # [T, X]
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)  # [T, k] each
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(x.dtype), experts


def moe_mlp(
    x: jax.Array,
    router: jax.Array,
    w_gate_up: Experts,
    w_down: Experts,
    *,
    top_k: int,
    renormalize: bool,
    impl: str = "auto",
) -> jax.Array:
    """x [T, E] -> [T, E]: each token's top-k experts' gated MLPs summed with the router's weights.
    Per-expert tuples take the per-expert forms; `impl` picks a stacked form."""
    weights, experts = route(x, router, top_k, renormalize)
    if isinstance(w_gate_up, tuple) or isinstance(w_down, tuple):
        if not (isinstance(w_gate_up, tuple) and isinstance(w_down, tuple)):
            raise ValueError("moe_mlp: gate|up and down weights must both be stacked or both per expert")
        return per_expert(x, weights, experts, w_gate_up, w_down)
    if impl == "auto":
        impl = _AUTO.get(target_backend(), "ragged")  # the mesh's platform: a TPU step traced here too
    if impl not in _FORMS:
        raise ValueError(f"unknown MoE impl {impl!r}; known: 'auto', {', '.join(map(repr, _FORMS))}")
    return shard_experts(_FORMS[impl], x, weights, experts, w_gate_up, w_down)


def dense_experts(
    x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate_up: Stacked, w_down: Stacked
) -> jax.Array:
    """Every expert on every token, X a batch dimension of both matmuls (contracting a stacked
    weight over its middle axis would transpose all of it first); an id past the last expert
    (another shard's) selects none."""
    num_experts = w_gate_up.shape[0]
    combine = jnp.einsum("tkx,tk->xt", jax.nn.one_hot(experts, num_experts, dtype=x.dtype), weights)
    gate_up = einsum("xte,xecf->xtcf", jnp.broadcast_to(x, (num_experts, *x.shape)), w_gate_up)
    hidden = jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1]  # [X, T, F]
    out = einsum("xtf,xfe->xte", hidden, w_down)
    return jnp.einsum("xte,xt->te", out, combine)


def replicas_as_rows(form: Form) -> Form:
    """A stacked form that also runs vmapped over data replicas (the compiled step: jax.vmap over
    [data]). Each token's output depends on that token alone, so the replicas' tokens run as the
    rows of one call: lax.ragged_dot(_general) has no batching rule for weights the replicas share;
    one call sorts all their rows by expert into one set of groups. Weights that differ per
    replica run one replica after another."""
    fn = jax.custom_batching.custom_vmap(form)

    @fn.def_vmap
    def _rule(axis_size: int, in_batched: list[Any], *args: Any) -> tuple[jax.Array, bool]:
        w_gate_up, w_down = args[3:]  # args: x, weights, experts, w_gate_up, w_down
        if any(jax.tree.leaves(in_batched[3:])):

            def replica(r: jax.Array) -> jax.Array:
                return form(
                    *(
                        jax.tree.map(lambda a, b: a[r] if b else a, arg, batched)
                        for arg, batched in zip(args, in_batched)
                    )
                )

            return jax.lax.map(replica, jnp.arange(axis_size)), True
        rows = [
            a if batched else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, batched in zip(args[:3], in_batched[:3])
        ]
        out = fn(*(a.reshape(-1, *a.shape[2:]) for a in rows), w_gate_up, w_down)
        return out.reshape(axis_size, -1, out.shape[-1]), True

    return fn


@replicas_as_rows
def ragged_experts(
    x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate_up: Stacked, w_down: Stacked
) -> jax.Array:
    """Rows sorted by expert, grouped matmuls; rows for an id past the last expert (another
    shard's) sort last, outside every group, and add nothing. Gate and up are one product with
    the weight's [2, F] axes as its output: as an [X, E, 2F] product (a reshape) XLA:TPU relaid
    the whole weight into that shape on every step (201 MB a layer per chip for Qwen3-30B-A3B
    at tensor=4), and slicing gate and up apart copied it in halves."""
    (t, top_k), num_experts = experts.shape, w_gate_up.shape[0]
    flat = experts.reshape(-1)  # [T*k]: row j is token j // k's (j % k)-th choice
    order = jnp.argsort(flat, stable=True)  # rows grouped by expert
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [X]
    row_expert = jnp.minimum(flat[order], num_experts - 1)  # [T*k]: the expert of each sorted row
    xs = x[order // top_k]  # [T*k, E]
    gate_up = _grouped_matmul(xs, w_gate_up, group_sizes, row_expert)  # [T*k, 2, F]
    hidden = jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]  # [T*k, F]
    out = _grouped_matmul(hidden, w_down, group_sizes, row_expert)  # [T*k, E], sorted
    out = jnp.where((flat[order] < num_experts)[:, None], out, 0)  # rows in no group: undefined
    out = jnp.zeros_like(out).at[order].set(out).reshape(t, top_k, -1)  # back to token order
    return jnp.einsum("tke,tk->te", out, weights)


def _map(w: Stacked, fn: Callable[[jax.Array], jax.Array]) -> Stacked:
    """fn on a float weight, or on each array of a quantized one."""
    return w.map(fn) if isinstance(w, QuantizedWeight) else fn(w)


_GROUPED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)


def _grouped_matmul(xs: jax.Array, w: Stacked, group_sizes: jax.Array, row_expert: jax.Array) -> jax.Array:
    """Grouped matmul (lax.ragged_dot_general) of rows xs [rows, in] sorted by expert with
    stacked weights w [X, in, out...] -> [rows, out...]: per-channel int8 runs on the integers
    and scales each row's output by its expert's scales; other quantized layouts are
    dequantized first."""

    def grouped(w: jax.Array) -> jax.Array:
        return jax.lax.ragged_dot_general(xs, w, group_sizes, _GROUPED, preferred_element_type=xs.dtype)

    if not isinstance(w, QuantizedWeight):
        return grouped(w)
    xs = xs if w.activations is None else fake_quantized("ti,xio->to", xs, w.activations)  # W8A8 / FP8
    if w.per_channel_int8:
        y = grouped(w.values if w.method == "int8" else w.values.astype(xs.dtype))  # [rows, out...]
        return y * w.scales[:, 0].astype(y.dtype)[row_expert]
    return grouped(dequantize(w, xs.dtype))


def capacity_experts(
    x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate_up: Stacked, w_down: Stacked
) -> jax.Array:
    """Each expert run once on its chosen tokens, packed into C rows ([slots, C, E] through one
    batched matmul over the experts), then gathered back to each token's choices.

    C = T is exact (a token chooses an expert at most once). Up to _EXACT_TOKENS tokens (decode)
    that is the form: reading the expert weights costs more than the padded rows' FLOPs. Past it
    C is a few times the mean group size, under a conditional that takes C = T where a group is
    larger, so nothing is ever dropped. Where the choices name few of the experts (3 * T * k <
    X), only those experts' weights are gathered and run (batch 1 of Qwen3-30B-A3B: 8 of 128).
    H200, Qwen3-30B-A3B shape, ragged_dot computed densely: decode batch 64 50.6 ms per step,
    a 512-token prefill 356 ms (benchmarks/RESULTS.md, 2026-11-26)."""
    (t, top_k), num_experts = experts.shape, w_gate_up.shape[0]
    counts = jnp.bincount(experts.reshape(-1), length=num_experts)  # [X]; other shards' ids dropped
    small = min(t, next_pow2(-(-4 * t * top_k // num_experts)))
    run = lambda capacity: _by_capacity(x, weights, experts, w_gate_up, w_down, counts, capacity)  # noqa: E731
    if t <= _EXACT_TOKENS or small >= t:
        return run(t)
    return jax.lax.cond(jnp.max(counts) <= small, lambda: run(small), lambda: run(t))


_EXACT_TOKENS = 128


def _by_capacity(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    w_gate_up: Stacked,
    w_down: Stacked,
    counts: jax.Array,
    capacity: int,
) -> jax.Array:
    """capacity_experts with C = `capacity` rows per expert (every group must fit)."""
    (t, top_k), num_experts = experts.shape, w_gate_up.shape[0]
    flat = experts.reshape(-1)  # [N = T*k]: row j is token j // k's (j % k)-th choice
    valid = flat < num_experts  # False: another shard's expert
    slots = min(num_experts, t * top_k)
    if 3 * slots < num_experts:  # few experts chosen: gather just their weights
        present = counts > 0
        slot_of = jnp.cumsum(present) - 1  # [X]: each chosen expert's slot
        (chosen,) = jnp.nonzero(present, size=slots, fill_value=0)  # [slots]; spare slots get no rows
        w_gate_up, w_down = (_map(w, lambda a: a[chosen]) for w in (w_gate_up, w_down))
    else:
        slots, slot_of = num_experts, jnp.arange(num_experts)
    order = jnp.argsort(flat, stable=True)  # rows grouped by expert
    first = jnp.cumsum(counts) - counts  # [X]: each group's first sorted row
    rank = jnp.zeros_like(flat).at[order].set(jnp.arange(t * top_k) - first[flat[order] % num_experts])
    slot = jnp.where(valid, slot_of[flat % num_experts], slots)  # [N]; `slots`: no slot (dropped)
    table = (
        jnp.full((slots, capacity), t, jnp.int32)
        .at[slot, rank]
        .set(  # [slots, C]: token ids
            jnp.arange(t * top_k, dtype=jnp.int32) // top_k, mode="drop"
        )
    )
    xs = jnp.pad(x, ((0, 1), (0, 0)))[table]  # [slots, C, E]; empty rows (token id T) 0
    gate_up = einsum("xte,xecf->xtcf", xs, w_gate_up)  # [slots, C, 2, F]
    out = einsum("xtf,xfe->xte", jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1], w_down)  # [slots, C, E]
    picked = out.at[slot, rank].get(mode="fill", fill_value=0).reshape(t, top_k, -1)  # [T, k, E]
    return jnp.einsum("tke,tk->te", picked, weights)


_FORMS = {"dense": dense_experts, "ragged": ragged_experts, "capacity": capacity_experts}
_AUTO = {"cpu": "dense", "gpu": "capacity", "cuda": "capacity", "rocm": "capacity"}


def per_expert(
    x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate_up: tuple[Stacked, ...], w_down: tuple[Stacked, ...]
) -> jax.Array:
    """The per-expert layout's forms (module docstring): under 64 tokens a loop over the choices,
    sorted by expert, with a switch over the experts in its body; from 64 a conditional per expert.
    Quantized experts always take the conditionals: each chosen expert's weights are converted
    once per step, where the loop converted them once per choice (one SmolLM2-sized layer, 8
    tokens, 2-core CPU: int8 3.2 against 8.0 ms, int4 2.4 against 12.2; float 2.4-2.7 either)."""
    (t, top_k), num_experts = experts.shape, len(w_gate_up)
    mlps = [lambda h, i=i: gated_mlp(h, w_gate_up[i], w_down[i]) for i in range(num_experts)]
    quantized = any(isinstance(w, QuantizedWeight) for w in (*w_gate_up, *w_down))
    if t < _FEWEST_PACKED and not quantized:

        def choice(out: jax.Array, c: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, None]:
            expert, weight, row = c
            y = jax.lax.switch(expert, mlps, jax.lax.dynamic_slice_in_dim(x, row, 1))  # [1, E]
            return out.at[row].add((y[0] * weight).astype(x.dtype)), None

        flat = experts.reshape(-1)
        order = jnp.argsort(flat)  # one expert's choices in a row: its weights stay in cache
        rows = (jnp.arange(t * top_k) // top_k)[order]
        out, _ = jax.lax.scan(choice, jnp.zeros_like(x), (flat[order], weights.reshape(-1)[order], rows))
        return out
    out = jnp.zeros_like(x)
    for i in range(num_experts):
        gate = jnp.sum(jnp.where(experts == i, weights, 0), axis=-1)  # [T]: token's weight on expert i
        out = out + _chosen_rows(mlps[i], x, gate)
    return out


_FEWEST_PACKED = 64  # from this many tokens on, each expert runs once on its packed rows


def _chosen_rows(mlp: Callable[[jax.Array], jax.Array], x: jax.Array, gate: jax.Array) -> jax.Array:
    """gate[:, None] * mlp(x) for the rows with a non-zero gate (others 0): the rows packed to the
    front, the MLP run on the fewest of T/8, T/4, T/2 or T rows that holds them (one branch per
    size), nothing run when no row has a gate."""
    t = x.shape[0]
    count = jnp.sum(gate != 0)
    sizes = [t // 8, t // 4, t // 2, t]
    order = jnp.argsort(gate == 0, stable=True)  # rows with a gate first

    def rows(n: int) -> Callable[[None], jax.Array]:
        def run(_: None) -> jax.Array:
            picked = order[:n]
            out = mlp(x[picked]) * gate[picked][:, None]
            return jnp.zeros_like(x).at[picked].add(out.astype(x.dtype))

        return run

    branches = [lambda _: jnp.zeros_like(x)] + [rows(n) for n in sizes]
    index = jnp.where(count == 0, 0, 1 + jnp.searchsorted(jnp.asarray(sizes), count))
    return jax.lax.switch(index, branches, None)
