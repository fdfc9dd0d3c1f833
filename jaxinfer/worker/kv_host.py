"""The host tier's bytes: KV pages evicted from the device, kept in host memory, copied back for
a prefix hit (the KV cache manager's HostTier decides which page goes where; jaxinfer/kv/host_tier.py).

    host = HostKV(state, num_slots)       buffers per cache: [slots, page, 2K, D] in host memory
    host.transfer([transfers, ...])       one Transfers per data replica, before the plan's step:
                                          offloads (device page -> slot) first, then loads

An offload gathers the evicted pages of every cache in one jitted call (issued before the step
that overwrites them: steps run in order on the device) and starts their copy to the host; the
copies land in the buffers at the next transfer, before any load reads a slot. A load scatters
the slots' pages into their device pages in one jitted call that donates the caches. Both work
on a fixed number of pages per call (the rest padding: the null page, read or written), so each
compiles once. An int8 / fp8 cache moves its pages as stored (its per-head scales are not per
page). With data replicas each replica has its own slots (a leading [data] axis).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.kv import NULL_PAGE, Transfers
from jaxinfer.quant.kv_cache import kv_pages, with_kv_pages


def host_page_bytes(caches: tuple[Any, ...], replicas: int) -> int:
    """Host bytes one slot of one replica takes: a page of every cache."""
    return sum(kv_pages(c).nbytes // (kv_pages(c).shape[-4] * replicas) for c in caches)


def host_slots(state: Any, gib: float) -> int:
    """Host-tier pages per data replica in `gib` GiB (0: off); refused where not one fits, and on
    several hosts."""
    if not gib:
        return 0
    per_slot = host_page_bytes(state.kv_caches, state.num_replicas)
    slots = int(gib * 2**30) // per_slot
    if slots < 1:
        raise ValueError(f"kv_offload_gb={gib}: less than one KV page of {per_slot} bytes (all layers)")
    if jax.process_count() > 1:
        raise ValueError(f"kv_offload_gb={gib}: the host tier runs on one host only (this engine spans several)")
    return slots


class HostKV:
    def __init__(self, state: Any, num_slots: int, width: int = 64) -> None:
        self.state, self.num_slots, self.width = state, num_slots, width
        self.replicas = state.num_replicas
        pages = [kv_pages(c) for c in state.kv_caches]
        lead = (self.replicas,) if self.replicas > 1 else ()
        self.buffers = [np.zeros((*lead, num_slots, *p.shape[-3:]), p.dtype) for p in pages]
        gather, scatter = _gather, _scatter
        if self.replicas > 1:
            gather = jax.vmap(_gather, spmd_axis_name="data")
            scatter = jax.vmap(_scatter, spmd_axis_name="data")
        self._gather = jax.jit(gather)
        formats = jax.tree.map(lambda c: c.format, state.kv_caches)
        self._scatter = jax.jit(scatter, donate_argnums=0, out_shardings=formats)
        self._pending: list[tuple[list[jax.Array], np.ndarray]] = []  # gathered, their slots [R?, W]
        ids = np.full((*lead, width), NULL_PAGE, np.int32)
        with state.mesh_context():  # compiled now, never after
            self._gather(state.kv_caches, ids)
            vals = [np.zeros((*lead, width, *p.shape[-3:]), p.dtype) for p in pages]
            state.kv_caches = self._scatter(state.kv_caches, ids, vals)

    def transfer(self, transfers: list[Transfers]) -> None:
        """Each replica's offloads, then its loads (module docstring)."""
        self._settle()
        most = max((len(t.offloads) for t in transfers), default=0)
        for start in range(0, most, self.width):
            pages, slots = self._batch([t.offloads[start : start + self.width] for t in transfers], True)
            with self.state.mesh_context():
                gathered = list(self._gather(self.state.kv_caches, pages))
            for g in gathered:
                g.copy_to_host_async()
            self._pending.append((gathered, slots))
        if any(t.loads for t in transfers):
            self._settle()
        most = max((len(t.loads) for t in transfers), default=0)
        for start in range(0, most, self.width):
            slots, pages = self._batch([t.loads[start : start + self.width] for t in transfers], False)
            vals = [self._read(buffer, slots) for buffer in self.buffers]
            with self.state.mesh_context():
                self.state.kv_caches = self._scatter(self.state.kv_caches, pages, vals)

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
            for buffer, g in zip(self.buffers, gathered):
                self._write(buffer, slots, np.asarray(g))
        self._pending = []

    def _write(self, buffer: np.ndarray, slots: np.ndarray, values: np.ndarray) -> None:
        if self.replicas == 1:
            real = slots >= 0
            buffer[slots[real]] = values[real]
            return
        for r in range(self.replicas):
            real = slots[r] >= 0
            buffer[r, slots[r][real]] = values[r][real]

    def _read(self, buffer: np.ndarray, slots: np.ndarray) -> np.ndarray:
        if self.replicas == 1:
            return buffer[slots]
        return np.stack([buffer[r, slots[r]] for r in range(self.replicas)])

    def num_compiled(self) -> int:
        return self._gather._cache_size() + self._scatter._cache_size()  # type: ignore[attr-defined]


def _gather(caches: tuple[Any, ...], pages: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(kv_pages(c)[pages] for c in caches)


def _scatter(caches: tuple[Any, ...], pages: jax.Array, values: list[jax.Array]) -> tuple[Any, ...]:
    return tuple(with_kv_pages(c, kv_pages(c).at[pages].set(jnp.asarray(v))) for c, v in zip(caches, values))
