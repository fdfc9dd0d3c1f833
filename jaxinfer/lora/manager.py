"""LoraManager: the engine's adapters -- known ones, device slots, and who uses which.

    manager = LoraManager(model_config, lora_config, write)   # write(slot, adapter): the worker's
    entry = manager.request_started(request_id, lora_request)  # at add_request: checked, counted
    manager.load_pending()                                     # before each launch: new slots written
    manager.request_finished(request_id)                       # its final output went out
    manager.load(name, path) / manager.unload(name)            # live, from the servers

A request is counted against its adapter from add_request until its final output, so an adapter
cannot be unloaded while a request waits for it or runs under it. Slots are acquired and released
by the schedulers as sequences start and stop running (slots.py); the weights of each slot newly
given to an adapter reach the device through `write`, on the launcher, before the step that
reads them. Plain Python (the device writes are the worker's).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from jaxinfer.config.lora import LoraConfig
from jaxinfer.config.model import ModelConfig
from jaxinfer.config.speculative import SpeculativeConfig
from jaxinfer.lora.peft import Adapter, AdapterError
from jaxinfer.lora.registry import AdapterEntry, AdapterRegistry
from jaxinfer.lora.request import LoRARequest
from jaxinfer.lora.slots import AdapterSlots
from jaxinfer.lora.stacking import served_modules

SlotWrite = Callable[[int, Adapter | None], None]


class LoraManager:
    def __init__(self, model: ModelConfig, config: LoraConfig, write: SlotWrite) -> None:
        self.config = config
        self.registry = AdapterRegistry(model, config.max_lora_rank, config.host_capacity, served_modules(config))
        self.slots = AdapterSlots(config.max_loras)
        self._write = write
        self._requests: dict[str, str] = {}  # request id -> adapter name
        self._users: collections.Counter[str] = collections.Counter()
        self.num_loads = 0  # adapters written into a slot so far
        for module in config.lora_modules:
            self.registry.add(module.name, module.path)

    def request_started(self, request_id: str, request: LoRARequest) -> AdapterEntry:
        """The adapter of a new request, loaded into host memory if it names a new one."""
        entry = self.registry.resolve(request)
        self._requests[request_id] = entry.name
        self._users[entry.name] += 1
        return entry

    def request_finished(self, request_id: str) -> None:
        name = self._requests.pop(request_id, None)
        if name is not None:
            self._users[name] -= 1
            if not self._users[name]:
                del self._users[name]

    def load_pending(self) -> None:
        """Writes the adapters the schedulers gave new slots into those slots."""
        for slot, name in self.slots.take_loads():
            self._write(slot, self.registry.adapter(name))
            self.num_loads += 1

    def load(self, name: str, path: str, adapter: Adapter | None = None) -> AdapterEntry:
        """Reads and checks a new adapter now, unless `adapter` is what reading `path` gave (read
        off the engine's thread); it reaches a device slot with its first request. AdapterError
        for a name already loaded (unload it first), as vLLM answers."""
        if name in self.registry:
            path = self.registry.entry(name).path
            raise AdapterError(f"LoRA adapter {name!r} is already loaded (from {path!r}); unload it first")
        return self.registry.add(name, path, adapter=adapter)

    def unload(self, name: str) -> AdapterEntry:
        """Forgets an adapter no request uses; AdapterError naming it otherwise."""
        entry = self.registry.entry(name)
        if self._users[name]:
            raise AdapterError(f"LoRA adapter {name!r} is in use by {self._users[name]} unfinished requests")
        self.slots.drop(name)
        return self.registry.remove(entry.name)

    @property
    def adapters(self) -> list[AdapterEntry]:
        return self.registry.entries

    def requests_per_adapter(self) -> dict[str, int]:
        """Unfinished requests by adapter name (every known adapter, 0 where none)."""
        return {e.name: self._users[e.name] for e in self.registry.entries}


def build_manager(
    config: LoraConfig, model: ModelConfig, write: SlotWrite, spec: SpeculativeConfig | None, multiprocess: bool
) -> LoraManager | None:
    """The engine's LoraManager (None with LoRA off); the combinations not served are refused."""
    if not config.enable_lora:
        return None
    if spec is not None and spec.method == "draft_model":
        raise ValueError(
            "enable_lora: a draft model (speculative_config method draft_model) with adapters is not supported"
        )
    if multiprocess:
        raise ValueError("enable_lora: adapters on several hosts (jax.distributed) are not supported yet")
    return LoraManager(model, config, write)


def lora_entry(manager: LoraManager | None, request_id: str, request: LoRARequest | None) -> AdapterEntry | None:
    """The adapter a new request runs under (None: the base model); ValueError when it asks for
    one and LoRA is off, or for an adapter that cannot be served (AdapterError names why)."""
    if request is None:
        return None
    if not isinstance(request, LoRARequest):
        raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
    if manager is None:
        raise ValueError(f"LoRA adapter {request.lora_name!r} asked for, but LoRA is off (enable_lora=True)")
    return manager.request_started(request_id, request)
