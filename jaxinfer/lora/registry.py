"""AdapterRegistry: the adapters an engine knows by name, and those read into host memory.

    add(name, path)      reads and checks the adapter (peft.py) once; a bad one is refused
                         here, before any request runs under it
    resolve(request)     a LoRARequest -> its entry (added on first use when it gives a path)
    adapter(name)        its weights, from the host cache (least recently used out past
                         `capacity`), read again from disk if they were dropped
    remove(name)         forgotten (unloading); the caller makes sure nothing uses it

Each entry has a `hash_root`: the prefix cache chains a sequence's page hashes from it, so the
same prompt under two adapters, or under one adapter before and after it was loaded again,
never shares KV pages (jaxinfer/kv/prefix_cache.py). Plain Python and numpy, no JAX.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
from pathlib import Path

from jaxinfer.config.model import ModelConfig
from jaxinfer.lora.peft import ALL_MODULES, Adapter, AdapterError, read_adapter
from jaxinfer.lora.request import LoRARequest


@dataclasses.dataclass(frozen=True)
class AdapterEntry:
    name: str
    path: str
    int_id: int
    hash_root: bytes  # 16 bytes, unique per load
    rank: int
    target_modules: tuple[str, ...]


class AdapterRegistry:
    def __init__(
        self, config: ModelConfig, max_rank: int, capacity: int, modules: tuple[str, ...] = ALL_MODULES
    ) -> None:
        self.config, self.max_rank, self.capacity = config, max_rank, capacity
        self.modules = modules  # those the device slots hold (lora/stacking.py's served_modules)
        self._entries: dict[str, AdapterEntry] = {}
        self._host: collections.OrderedDict[str, Adapter] = collections.OrderedDict()
        self._loads = itertools.count(1)

    def add(self, name: str, path: str, int_id: int | None = None, adapter: Adapter | None = None) -> AdapterEntry:
        """Reads and checks the adapter at `path` under `name` (`adapter`: what reading it gave
        already); the entry already there when the same name and path are known; AdapterError
        for another path under a known name."""
        known = self._entries.get(name)
        resolved = str(Path(path).expanduser().resolve()) if path else ""
        if known is not None:
            if resolved and resolved != known.path:
                raise AdapterError(
                    f"LoRA adapter {name!r} is already loaded from {known.path!r}; unload it before "
                    f"loading {path!r} under that name"
                )
            return known
        if not path:
            raise AdapterError(f"LoRA adapter {name!r} is not loaded and no path was given for it")
        if adapter is None:
            adapter = self.read(resolved)
        load = next(self._loads)
        root = hashlib.sha256(f"lora\0{name}\0{resolved}\0{load}".encode()).digest()[:16]
        entry = AdapterEntry(
            name, resolved, int_id if int_id is not None else load, root, adapter.rank, tuple(adapter.target_modules)
        )
        self._entries[name] = entry
        self._keep(name, adapter)
        return entry

    def read(self, path: str) -> Adapter:
        """The adapter at `path`, read and checked as this engine serves adapters (no state changes:
        the servers read off the engine's thread)."""
        return read_adapter(path, self.config, self.max_rank, self.modules)

    def resolve(self, request: LoRARequest) -> AdapterEntry:
        return self.add(request.lora_name, request.lora_path, request.lora_int_id)

    def adapter(self, name: str) -> Adapter:
        """The adapter's weights (read again if the host cache dropped them)."""
        adapter = self._host.get(name)
        if adapter is None:
            entry = self.entry(name)
            adapter = self.read(entry.path)
        self._keep(name, adapter)
        return adapter

    def _keep(self, name: str, adapter: Adapter) -> None:
        self._host[name] = adapter
        self._host.move_to_end(name)
        while len(self._host) > self.capacity:
            self._host.popitem(last=False)

    def entry(self, name: str) -> AdapterEntry:
        entry = self._entries.get(name)
        if entry is None:
            raise AdapterError(f"unknown LoRA adapter {name!r} (loaded: {sorted(self._entries)})")
        return entry

    def remove(self, name: str) -> AdapterEntry:
        entry = self.entry(name)
        del self._entries[name]
        self._host.pop(name, None)
        return entry

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    @property
    def entries(self) -> list[AdapterEntry]:
        return list(self._entries.values())

    @property
    def num_in_host_memory(self) -> int:
        return len(self._host)
