"""AdapterSlots: which adapter each device slot holds, and who uses it (plain Python, no JAX).

The device has `num_slots` adapter slots (1..num_slots; 0 is "no adapter"). The scheduler
`acquire`s a slot for a sequence it admits and `release`s it when the sequence finishes or is
preempted. A slot whose adapter no running sequence uses stays loaded (least recently used first
out), so the next request for that adapter needs no copy; a slot in use is never given away, and
when every slot is in use `acquire` says None (the request waits, others go on). Each slot newly
given to an adapter is queued in `take_loads()` for the worker, which writes the adapter's
weights into it before the step that first reads it.
"""

from __future__ import annotations

import collections


class AdapterSlots:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"AdapterSlots: num_slots={num_slots} must be >= 1")
        self.num_slots = num_slots
        self._slot: dict[str, int] = {}  # adapter name -> its slot
        self._users: collections.Counter[str] = collections.Counter()
        self._idle: collections.OrderedDict[str, None] = collections.OrderedDict()  # loaded, unused; LRU first
        self._free = list(range(num_slots, 0, -1))  # pop() gives the lowest
        self._loads: list[tuple[int, str]] = []

    def acquire(self, name: str) -> int | None:
        """The slot holding `name` for one more user (loading it into a free or idle slot), or
        None when every slot is in use."""
        slot = self._slot.get(name)
        if slot is None:
            if self._free:
                slot = self._free.pop()
            elif self._idle:
                victim, _ = self._idle.popitem(last=False)
                slot = self._slot.pop(victim)
            else:
                return None
            self._slot[name] = slot
            self._loads.append((slot, name))
        self._idle.pop(name, None)
        self._users[name] += 1
        return slot

    def release(self, name: str) -> None:
        """One user of `name` is done; with none left its slot becomes idle (still loaded)."""
        if self._users[name] <= 0:
            raise ValueError(f"AdapterSlots.release({name!r}): the adapter has no users")
        self._users[name] -= 1
        if self._users[name] == 0:
            del self._users[name]
            self._idle[name] = None

    def drop(self, name: str) -> None:
        """Forgets the adapter (unloaded): its slot is free again. Refused while it is in use."""
        if self._users[name] > 0:
            raise ValueError(f"adapter {name!r} is in use by {self._users[name]} running sequences")
        slot = self._slot.pop(name, None)
        self._idle.pop(name, None)
        if slot is not None:
            self._free.append(slot)
            self._free.sort(reverse=True)
            self._loads = [(s, n) for s, n in self._loads if n != name]

    def take_loads(self) -> list[tuple[int, str]]:
        """(slot, adapter name) of every slot given a new adapter since the last call."""
        loads, self._loads = self._loads, []
        return loads

    def slot_of(self, name: str) -> int | None:
        return self._slot.get(name)

    @property
    def loaded(self) -> dict[str, int]:
        """Adapter name -> slot, for every adapter on the device."""
        return dict(self._slot)

    def users(self, name: str) -> int:
        return self._users[name]
