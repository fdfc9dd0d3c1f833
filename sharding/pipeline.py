"""Several batches in flight over pipeline stages: one tick of the pipeline (device side).

`stages.run_stages` takes one batch through every stage in turn, so while one stage works the
others wait. With S batches in flight, one call advances every one of them by a stage:

    tick k    stage 0 runs the batch entering now (its embedded tokens); stage s > 0 runs what
              stage s - 1 produced at tick k - 1 (the batch that entered at tick k - s), each
              on its own batch's metadata (extras[s]: positions, page table, KV write slots)
    result    the last stage's output (the batch that entered at tick k - S + 1, now through
              every layer: the final norm, LM head and sampler follow over the whole mesh) and
              the activations handed on by one collective permute, each stage's input at k + 1

The activations in flight, [S, T, E], are split over `stage` (a stage's devices hold their own
input only) and go from one call to the next as the KV cache does; `extras` has a leading [S]
axis split the same way. Every batch in flight is padded to the same token bucket T. A stage with
no batch this tick (the pipeline filling or draining) runs on padding metadata, whose K/V writes
land in the reserved null page, and its output is never read.

The engine's side (virtual replicas taking turns, the ring of batches in flight, each batch's
tokens sampled S - 1 ticks after it entered) is jaxinfer's: core/turns.py, worker/pipelined.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sharding.mesh import STAGE, current_mesh
from sharding.stages import num_stages, stage_slots

PyTree = Any


def pipeline_tick(
    slot: Callable[[int, jax.Array, PyTree, PyTree, PyTree], tuple[jax.Array, PyTree]],
    inflight: jax.Array,
    entering: jax.Array,
    slots: tuple[PyTree, ...],
    caches: tuple[PyTree, ...],
    extras: PyTree,
) -> tuple[jax.Array, jax.Array, tuple]:
    """One tick (module docstring). `inflight` [S, T, E]: row s > 0 is stage s's input (row 0 is
    not read); `entering` [T, E]: stage 0's; `extras`: every leaf [S, ...], row s for stage s;
    `slot`, `slots` and `caches` as `run_stages` takes them. Returns (the last stage's output
    [T, E] on every device, the next tick's `inflight`, the caches)."""
    mesh = current_mesh()
    n = num_stages(mesh)
    if inflight.shape[0] != n:
        raise ValueError(f"{inflight.shape[0]} activations in flight for {n} pipeline stages")
    if len(caches) != len(slots):
        raise ValueError(f"{len(caches)} KV caches for {len(slots)} pipeline slots")

    def local(inflight: jax.Array, entering: jax.Array, slots: tuple, caches: tuple, extras: PyTree) -> tuple:
        stage = jax.lax.axis_index(STAGE)
        x = jnp.where(stage == 0, entering, inflight[0])
        x, caches = stage_slots(slot, x, slots, caches, jax.tree.map(lambda a: a[0], extras))
        handed = jax.lax.ppermute(x, STAGE, [(s, s + 1) for s in range(n - 1)])  # stage 0 gets zeros
        done = jax.lax.psum(jnp.where(stage == n - 1, x, jnp.zeros_like(x)), STAGE)
        return done, handed[None], caches

    slot_specs = jax.tree.map(lambda _: P(STAGE), slots)
    cache_specs = jax.tree.map(lambda _: P(None, STAGE), caches)
    extra_specs = jax.tree.map(lambda _: P(STAGE), extras)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(STAGE), P(), slot_specs, cache_specs, extra_specs),
        out_specs=(P(), P(STAGE), cache_specs),
        axis_names={STAGE},
        check_vma=False,
    )(inflight, entering, slots, caches, extras)
