"""HostTier: the prefix cache's second tier -- cached pages evicted from the device, kept in host
memory (plain Python: slots and their bookkeeping; the worker holds the bytes).

    a cached device page evicted --store()--> a host slot (a free one, else the least recently
                                              used entry's), and an offload (device page, slot)
                                              the worker copies out before the step that reuses
                                              the page runs
    a prefix lookup --lookup()--> the slot holding that page of that group, if its tokens and
                                  parent are the prompt's; refreshed as most recently used
    a hit admitted --pin(), load()--> a load (slot, device page) the worker copies in before the
                                      step that reads it; the slot is pinned until then (never
                                      evicted for an offload of the same plan)

    a preempted sequence's pages --swap_out()--> slots held for it outside the LRU (swap.py),
                                                 loaded back at its readmission; freed by
                                                 release_swapped() once those loads are taken

Entries are keyed by (layer group, page hash): each group of the KV layout caches its own
pages (groups.py). `take_transfers()` hands the worker the plan's offloads and loads, offloads
first: a device page evicted and reused by a load in the same plan is read out before it is
written.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from jaxinfer.kv.prefix_cache import CacheEntry, PageHash


@dataclasses.dataclass
class Transfers:
    """A plan's copies between the tiers, in the order the worker must make them."""

    offloads: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (device page, host slot)
    loads: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (host slot, device page)

    def __bool__(self) -> bool:
        return bool(self.offloads or self.loads)


class HostTier:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"a host tier of {num_slots} pages holds no page")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: slot 0 first
        # (group, page hash) -> the prefix cache's entry, its page id the host slot; LRU first
        self._entries: collections.OrderedDict[tuple[int, PageHash], CacheEntry] = collections.OrderedDict()
        self._pinned: set[int] = set()  # slots with a load not handed to the worker yet
        self._swapped: set[int] = set()  # slots held for preempted sequences (swap.py)
        self._released: list[int] = []  # swapped slots given back, free once the transfers are taken
        self.epoch = 0  # bumped by clear(): swaps taken before it hold stale KV
        self._transfers = Transfers()
        self.num_stored = 0  # pages copied out over the tier's life
        self.num_loaded = 0  # pages copied back
        self.num_swapped_out = 0  # pages of preempted sequences copied out

    @property
    def num_used(self) -> int:
        return len(self._entries) + len(self._swapped)

    @property
    def num_swapped(self) -> int:
        """Slots held for preempted sequences."""
        return len(self._swapped)

    def store(self, group: int, page_hash: PageHash, entry: CacheEntry, page: int) -> None:
        """Keeps the content of device page `page` (group `group`'s cached `entry`, evicted)."""
        key = (group, page_hash)
        if key in self._entries:  # already here (loaded back before): nothing to copy
            self._entries.move_to_end(key)
            return
        slot = self._take_slot()
        if slot is None:
            return  # every slot waits for a load: the page is lost, as without the tier
        self._entries[key] = CacheEntry(slot, entry.parent, entry.token_ids)
        self._transfers.offloads.append((page, slot))
        self.num_stored += 1

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for key, entry in self._entries.items():  # least recently used first
            if entry.page_id not in self._pinned:
                del self._entries[key]
                return entry.page_id
        return None

    def lookup(self, group: int, page_hash: PageHash, parent: PageHash | None, token_ids: Sequence[int]) -> int | None:
        """The slot holding group `group`'s page `page_hash` after `parent` with exactly
        `token_ids`, refreshed as most recently used; None if the tier has no such page."""
        key = (group, page_hash)
        entry = self._entries.get(key)
        if entry is None or entry.parent != parent or entry.token_ids != tuple(token_ids):
            return None
        self._entries.move_to_end(key)
        return entry.page_id

    def pin(self, slots: Sequence[int]) -> None:
        """Keeps these slots from offloads until the plan's transfers are taken (a hit on them
        is being admitted: pin, allocate its pages, whose evictions may offload, then load)."""
        self._pinned.update(slots)

    def load(self, slot: int, page: int) -> None:
        """Asks for slot `slot` (pinned) copied into device page `page` before the step that reads it."""
        self._transfers.loads.append((slot, page))
        self.num_loaded += 1

    def swap_out(self, pages: Sequence[int]) -> list[int] | None:
        """Slots holding these device pages' content for a preempted sequence (offloads queued;
        no LRU eviction takes them); None, with nothing taken, if the tier cannot hold them all."""
        evictable = sum(entry.page_id not in self._pinned for entry in self._entries.values())
        if len(pages) > len(self._free) + evictable:
            return None
        slots = []
        for page in pages:
            slot = self._take_slot()
            assert slot is not None  # counted above
            slots.append(slot)
            self._transfers.offloads.append((page, slot))
        self._swapped.update(slots)
        self.num_swapped_out += len(pages)
        return slots

    def release_swapped(self, slots: Sequence[int]) -> None:
        """Gives swapped slots back, free once this plan's transfers are taken (its loads read them first)."""
        self._swapped.difference_update(slots)
        self._released += slots

    def take_transfers(self) -> Transfers:
        """The offloads and loads since the last call; their slots are no longer pinned (the
        worker makes the copies before any later plan's)."""
        transfers, self._transfers = self._transfers, Transfers()
        self._pinned.clear()
        self._free += self._released
        self._released = []
        return transfers

    def clear(self) -> None:
        """Forgets every entry (new weights: nothing cached still holds); slots held for swapped
        sequences stay theirs until they return (and find their swap stale: `epoch`)."""
        self._entries.clear()
        held = self._swapped.union(self._released)
        self._free = [s for s in range(self.num_slots - 1, -1, -1) if s not in held]
        self.epoch += 1
