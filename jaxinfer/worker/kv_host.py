"""The host tier's bytes: KV pages evicted from the device (or swapped out with a preempted
sequence), kept in host memory, copied back when a sequence needs them (the KV cache manager's
HostTier decides which page goes where; jaxinfer/kv/host_tier.py, jaxinfer/kv/swap.py).

    host = HostKV(state, num_slots)       per cache, per shard of it this process holds:
                                          [slots, page, 2K_shard, D] numpy buffers
    host.transfer([transfers, ...])       one Transfers per data replica, before the plan's step:
                                          offloads (device page -> slot) first, then loads

An offload gathers the evicted pages of every cache in one jitted call (issued before the step
that overwrites them: steps run in order on the device) and starts their copy to the host; the
copies land in the buffers at the next transfer, before any load reads a slot. A load builds the
slots' pages as an array from the buffers and scatters it into the device pages in one jitted
call that donates the caches. Both work on a fixed number of pages per call (the rest padding:
the null page, read or written), so each compiles once. Where the backend offers pinned host
memory the gathered pages land there and the loaded ones start there (the DMA engines' memory);
the slot buffers themselves are plain numpy. An int8 / fp8 cache moves its pages as stored (its
per-head scales are not per page). With data replicas each replica has its own slots.

Each process keeps the shards of the pages its own devices hold (a tensor-sharded cache: its
heads), so the tier works across hosts: process 0 decides, and sends each transfer call's page
and slot ids to the others through the step channel before making it (their `follow()` makes the
same calls in the same order, sharding/multihost.py).

At start-up the tier times its two calls (`transfer_seconds`): with the step's cost per token,
that is what the swap cost model weighs (kv/swap.py).
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.kv import NULL_PAGE, Transfers
from jaxinfer.quant.kv_cache import kv_pages, with_kv_pages
from sharding import StepChannel
from sharding.multihost import put_inputs

OFFLOAD, LOAD = 0, 1


def host_page_bytes(caches: tuple[Any, ...], replicas: int) -> int:
    """Host bytes one slot of one replica takes: a page of every cache (all its shards)."""
    return sum(kv_pages(c).nbytes // (kv_pages(c).shape[-4] * replicas) for c in caches)


def host_slots(state: Any, gib: float) -> int:
    """Host-tier pages per data replica in `gib` GiB (0: off); refused where not one fits."""
    if not gib:
        return 0
    per_slot = host_page_bytes(state.kv_caches, state.num_replicas)
    slots = int(gib * 2**30) // per_slot
    if slots < 1:
        raise ValueError(f"kv_offload_gb={gib}: less than one KV page of {per_slot} bytes (all layers)")
    return slots


def staging(sharding: jax.sharding.Sharding, device: jax.Device) -> jax.sharding.Sharding:
    """`sharding` in pinned host memory where the device offers it (else as it is)."""
    kinds = {memory.kind for memory in device.addressable_memories()}
    return sharding.with_memory_kind("pinned_host") if "pinned_host" in kinds else sharding


class HostKV:
    def __init__(self, state: Any, num_slots: int, width: int = 64, channel: StepChannel | None = None) -> None:
        self.state, self.num_slots, self.width, self.channel = state, num_slots, width, channel
        self.replicas = state.num_replicas
        pages = [kv_pages(c) for c in state.kv_caches]
        lead = (self.replicas,) if self.replicas > 1 else ()
        self._shapes = [(*lead, width, *p.shape[-3:]) for p in pages]
        self._staged = [staging(p.sharding, state.local_device) for p in pages]
        self.buffers = [self._shard_buffers(p, s, shape) for p, s, shape in zip(pages, self._staged, self._shapes)]
        gather, scatter = gather_pages, scatter_pages
        if self.replicas > 1:
            gather = jax.vmap(gather_pages, spmd_axis_name="data")
            scatter = jax.vmap(scatter_pages, spmd_axis_name="data")
        self._gather = jax.jit(gather, out_shardings=tuple(self._staged))
        formats = jax.tree.map(lambda c: c.format, state.kv_caches)
        self._scatter = jax.jit(scatter, donate_argnums=0, out_shardings=formats)
        self._pending: list[tuple[list[jax.Array], np.ndarray]] = []  # gathered, their slots [R?, W]
        self.transfer_seconds = self._time_calls()  # compiled now, never after

    def _shard_buffers(self, pages: jax.Array, staged: jax.sharding.Sharding, shape: tuple) -> dict:
        """Slot buffers for the shards of a gathered batch this process holds, by shard index."""
        piece = list(staged.shard_shape(shape))
        piece[len(shape) - 4] = self.num_slots
        indices = staged.addressable_devices_indices_map(shape).values()
        return {_key(index, shape): np.zeros(piece, pages.dtype) for index in indices if index is not None}

    def _time_calls(self) -> float:
        """Seconds of one offload and one load call (median of three, after a first run compiles)."""
        ids = np.full((self.replicas, self.width), NULL_PAGE, np.int32)[0 if self.replicas == 1 else slice(None)]
        runs = []
        for _ in range(4):
            start = time.perf_counter()
            self._run(OFFLOAD, ids, np.full_like(ids, -1), send=False)
            self._settle()
            self._run(LOAD, np.zeros_like(ids), ids, send=False)
            jax.block_until_ready(self.state.kv_caches)
            runs.append(time.perf_counter() - start)
        return float(np.median(runs[1:]))

    def transfer(self, transfers: list[Transfers]) -> None:
        """Each replica's offloads, then its loads (module docstring), each call also sent to the
        other processes first where there are several."""
        self._settle()
        most = max((len(t.offloads) for t in transfers), default=0)
        for start in range(0, most, self.width):
            self._run(OFFLOAD, *self._batch([t.offloads[start : start + self.width] for t in transfers], True))
        most = max((len(t.loads) for t in transfers), default=0)
        for start in range(0, most, self.width):
            self._run(LOAD, *self._batch([t.loads[start : start + self.width] for t in transfers], False))

    def _run(self, kind: int, first: np.ndarray, second: np.ndarray, send: bool = True) -> None:
        """One call: OFFLOAD (pages, slots) or LOAD (slots, pages); what a follower runs too."""
        if send and self.channel is not None:
            self.channel.send_transfer(kind, np.stack([first, second]))
        if kind == OFFLOAD:
            with self.state.mesh_context():
                gathered = list(self._gather(self.state.kv_caches, self._ids(first)))
            for g in gathered:
                g.copy_to_host_async()
            self._pending.append((gathered, second))
            return
        self._settle()
        vals = [self._read(i, first) for i in range(len(self.buffers))]
        with self.state.mesh_context():
            self.state.kv_caches = self._scatter(self.state.kv_caches, self._ids(second), vals)

    def follow(self, kind: int, ids: np.ndarray) -> None:
        """A follower process: process 0's call with these ids (sharding.StepChannel)."""
        self._run(kind, ids[0], ids[1], send=False)

    @property
    def id_template(self) -> np.ndarray:
        """What one call's ids look like on the step channel: [2, R?, width]."""
        lead = (self.replicas,) if self.replicas > 1 else ()
        return np.zeros((2, *lead, self.width), np.int32)

    def _ids(self, ids: np.ndarray) -> jax.Array:
        return put_inputs(ids, self.state.home)

    def _batch(self, pairs: list[list[tuple[int, int]]], offloads: bool) -> tuple[np.ndarray, np.ndarray]:
        """Each replica's pairs as two id arrays [R?, width]: padding pages are the null page,
        padding slots -1 (an offload writes no slot for them; a load reads the last one into the
        null page)."""
        pad = (NULL_PAGE, -1) if offloads else (-1, NULL_PAGE)
        first = np.full((len(pairs), self.width), pad[0], np.int32)
        second = np.full((len(pairs), self.width), pad[1], np.int32)
        for r, replica_pairs in enumerate(pairs):
            if replica_pairs:
                first[r, : len(replica_pairs)], second[r, : len(replica_pairs)] = zip(*replica_pairs)
        if self.replicas == 1:
            return first[0], second[0]
        return first, second

    def _settle(self) -> None:
        """The offloads started so far, copied into their slots (in order: a later one wins)."""
        for gathered, slots in self._pending:
            for i, g in enumerate(gathered):
                seen = set()
                for shard in g.addressable_shards:
                    key = _key(shard.index, g.shape)
                    if key not in seen:
                        seen.add(key)
                        self._write(self.buffers[i][key], self._replicas_of(key), slots, np.asarray(shard.data))
        self._pending = []

    def _replicas_of(self, key: tuple) -> range:
        return range(*key[0][:2]) if self.replicas > 1 else range(1)

    def _write(self, buffer: np.ndarray, replicas: range, slots: np.ndarray, values: np.ndarray) -> None:
        if self.replicas == 1:
            real = slots >= 0
            buffer[slots[real]] = values[real]
            return
        for j, r in enumerate(replicas):
            real = slots[r] >= 0
            buffer[j, slots[r][real]] = values[j][real]

    def _read(self, cache: int, slots: np.ndarray) -> jax.Array:
        """The slots' pages of one cache as an array placed like a gathered batch."""
        shape, buffers = self._shapes[cache], self.buffers[cache]

        def piece(index: tuple[slice, ...] | None) -> np.ndarray:
            key = _key(index or (), shape)
            buffer = buffers[key]
            if self.replicas == 1:
                return buffer[slots]
            return np.stack([buffer[j, slots[r]] for j, r in enumerate(self._replicas_of(key))])

        return jax.make_array_from_callback(shape, self._staged[cache], piece)

    def num_compiled(self) -> int:
        return self._gather._cache_size() + self._scatter._cache_size()  # type: ignore[attr-defined]


def _key(index: tuple, shape: tuple) -> tuple:
    """A shard's index as plain (start, stop, step) triples (slices of the same shard compare equal)."""
    return tuple(s.indices(n) for s, n in zip(index, shape))


def gather_pages(caches: tuple[Any, ...], pages: jax.Array) -> tuple[jax.Array, ...]:
    """Pages `pages` of every cache (as stored), one array per cache."""
    return tuple(kv_pages(c)[pages] for c in caches)


def scatter_pages(caches: tuple[Any, ...], pages: jax.Array, values: list[jax.Array]) -> tuple[Any, ...]:
    """The caches with pages `pages` of each set to its values."""
    return tuple(with_kv_pages(c, kv_pages(c).at[pages].set(jnp.asarray(v))) for c, v in zip(caches, values))
