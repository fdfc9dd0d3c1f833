"""The page table on the device: one row per sequence slot and layer group, and only its
changed entries sent.

    device   table i32[G, num_rows, pages_per_seq]   a table per layer group of the model's KV
             layout (config/kv_layout.py; G = 1 where its layers attend alike). Row 0 is the null
             row (all page 0, never assigned): padding sequences read it; row r > 0 is one
             sequence's block table of that group
    host     PageTableMirror: what the device's table holds, the slot of each sequence, and
             for a plan the entries that differ from it -> PageTableUpdates (group, slot, col, page)
    step     page_indices [G, S, pages_per_seq] = table[:, page_slots] inside the jit

A step's inputs carry the slot of each of its sequences (`StepInputs.page_slots`) and the
entries of the table to set first (`StepInputs.table`): a decode that fills no new page sends
nothing, one that starts a page sends one entry, a new sequence sends its row. The updates are
padded to the smallest of a few fixed widths (`update_widths`, each compiled at warm-up) and
applied by one small jitted scatter that updates the table in place, before the step that reads
it. Padding entries write page 0 into the null row's first column, which it already holds.

Slots: a sequence keeps its slot (the same row in every group) while it runs; a new one takes
a free slot, else the slot used least recently by a sequence outside the plan (there are as many
slots as the largest plan has sequences, so one is always found). With several batches in flight
(pipeline stages: `in_flight` plans at once) there are that many times the slots, and a slot named
by one of the last `in_flight - 1` plans is not taken over: a batch in flight still reads its row.
A row is exact: entries past a sequence's pages hold the null page (a slot taken over, or a
sequence that gave pages back, has the rest cleared), so no sequence's row ever names a page it
does not own.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.core.plan import ScheduledSeq
from jaxinfer.kv import NULL_PAGE
from jaxinfer.sampling.arrays import HostOrDevice

NULL_ROW = 0
_WIDTH_STEP = 8  # each update width 8x the one before


@flax.struct.dataclass(frozen=True)  # as flax makes it; said for the type checker: `A` is covariant
class PageTableUpdates[A]:
    """`A`: the arrays' type, as in SamplingArrays (numpy on the host, jax.Array on the device)."""

    slots: A  # i32[W] table row of each entry (padding: the null row)
    cols: A  # i32[W] page position in the row
    pages: A  # i32[W] the page id to store
    groups: A  # i32[W] the layer group's table


def update_widths(num_rows: int, pages_per_seq: int, smallest: int = 64, num_groups: int = 1) -> tuple[int, ...]:
    """The compiled update widths: `smallest`, 8x that, ... up to one that holds every entry of
    every sequence row of every group (the most one step can change)."""
    widths, most = [smallest], num_groups * (num_rows - 1) * pages_per_seq
    while widths[-1] < most:
        widths.append(widths[-1] * _WIDTH_STEP)
    return tuple(widths)


def no_updates(width: int) -> PageTableUpdates[np.ndarray]:
    zeros = np.zeros(width, np.int32)
    return PageTableUpdates(zeros, zeros.copy(), zeros.copy(), zeros.copy())


def apply_updates(table: jax.Array, updates: PageTableUpdates[jax.Array]) -> jax.Array:
    """The table with the entries set (jitted with the table donated: in place)."""
    return table.at[updates.groups, updates.slots, updates.cols].set(updates.pages)


def padded_updates(
    changes: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]], widths: tuple[int, ...]
) -> PageTableUpdates[np.ndarray] | None:
    """Each data replica's changed entries, padded to the smallest width that holds the most
    of them (stacked along a leading axis when there are several replicas); None: none changed."""
    most = max(len(c[0]) for c in changes)
    if most == 0:
        return None
    width = next(w for w in widths if w >= most)
    rows = []
    for slots, cols, pages, groups in changes:
        out = no_updates(width)
        n = len(slots)
        out.slots[:n], out.cols[:n], out.pages[:n], out.groups[:n] = slots, cols, pages, groups
        rows.append(out)
    return rows[0] if len(rows) == 1 else jax.tree.map(lambda *r: np.stack(r), *rows)


class PageTableMirror:
    """The host's copy of one replica's device table and the slot of each sequence."""

    def __init__(self, num_rows: int, pages_per_seq: int, num_groups: int = 1, in_flight: int = 1):
        self.in_flight = in_flight  # plans whose batches may still read their rows (module docstring)
        self.rows = np.full((num_groups, num_rows, pages_per_seq), NULL_PAGE, np.int32)
        self.lens = np.zeros((num_groups, num_rows), np.int32)  # entries of each row past which all are null
        self.owner = np.full(num_rows, -1, np.int64)  # seq_id of the slot's sequence; -1: free
        self.used = np.zeros(num_rows, np.int64)  # the sync that last named the slot
        self.owner[NULL_ROW] = -2  # never assigned
        self.slot_of: dict[int, int] = {}
        self._clock = 0

    def sync(
        self, entries: Seq[ScheduledSeq], s_bucket: int
    ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """(page slot of each sequence [s_bucket], padding: the null row; the entries to set:
        slots, cols, pages, groups) for a plan's sequences, whose rows become their pages."""
        self._clock += 1
        n = len(entries)
        slots = np.full(s_bucket, NULL_ROW, np.int32)
        plan_ids = [e.seq.seq_id for e in entries]
        for i, seq_id in enumerate(plan_ids):
            slot = self.slot_of.get(seq_id)
            slots[i] = self._assign(seq_id, plan_ids) if slot is None else slot
        mine = slots[:n]
        if n == 0:
            return slots, (mine, mine, mine, mine)
        self.used[mine] = self._clock
        changed = [self._sync_group(g, [e.tables[g] for e in entries], mine) for g in range(len(self.rows))]
        return slots, tuple(np.concatenate(parts) for parts in zip(*changed))  # type: ignore[return-value]

    def _sync_group(
        self, group: int, tables: list[tuple[int, ...]], mine: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Group `group`'s rows of slots `mine` set to `tables`: the entries that changed."""
        rows, n = self.rows[group], len(tables)
        lens = np.fromiter((len(t) for t in tables), np.int32, n)
        width = int(max(lens.max(), self.lens[group, mine].max()))
        target = np.full((n, width), NULL_PAGE, np.int32)
        target[np.arange(width) < lens[:, None]] = np.fromiter(
            itertools.chain.from_iterable(tables), np.int32, int(lens.sum())
        )
        r, c = np.nonzero(rows[mine, :width] != target)
        rows[mine, :width] = target
        self.lens[group, mine] = lens
        return mine[r], c.astype(np.int32), target[r, c], np.full(len(r), group, np.int32)

    def _assign(self, seq_id: int, plan_ids: list[int]) -> int:
        """A slot for a sequence that has none: a free one, else the least recently used one
        whose sequence is not in this plan (its row is rewritten by the caller's diff)."""
        free = np.flatnonzero(self.owner == -1)
        if free.size:
            slot = int(free[0])
        else:
            idle = self.used <= self._clock - self.in_flight  # named by none of the plans in flight
            candidates = np.flatnonzero(~np.isin(self.owner, plan_ids) & (self.owner != -2) & idle)
            if not candidates.size:
                raise RuntimeError(f"{len(plan_ids)} sequences in one step, {len(self.owner) - 1} page-table slots")
            slot = int(candidates[np.argmin(self.used[candidates])])
            del self.slot_of[int(self.owner[slot])]
        self.owner[slot] = seq_id
        self.slot_of[seq_id] = slot
        return slot

    def page_rows(self, slots: np.ndarray) -> np.ndarray:
        """The rows the step reads for these slots, [G, S, P] (what `page_indices` holds on the device)."""
        return self.rows[:, slots]


class DevicePageTable:
    """The table on the device (one per data replica, stacked) and the jitted scatter that sets
    a step's entries in place (the worker's warm-up compiles it for each update width)."""

    def __init__(
        self,
        num_groups: int,
        num_rows: int,
        pages_per_seq: int,
        sharding: jax.sharding.Sharding,
        num_replicas: int,
        vmap_axis: str,
    ):
        shape: tuple[int, ...] = (num_groups, num_rows, pages_per_seq)
        if num_replicas > 1:
            shape = (num_replicas, *shape)
        self.array = jax.device_put(jnp.zeros(shape, jnp.int32), sharding)  # as the compiled step's prev tokens
        fn = apply_updates if num_replicas == 1 else jax.vmap(apply_updates, spmd_axis_name=vmap_axis)
        self._update = jax.jit(fn, donate_argnums=(0,), out_shardings=sharding)
        self.num_replicas = num_replicas

    def apply(self, updates: PageTableUpdates[HostOrDevice]) -> None:
        """Sets the entries (placed like the table's other inputs) before the next step reads it."""
        self.array = self._update(self.array, updates)

    def num_compiled(self) -> int:
        return self._update._cache_size()  # type: ignore[attr-defined]  # jit's count; not in jax's stubs
