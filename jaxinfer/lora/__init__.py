"""LoRA adapters on the host (no JAX): PEFT reading and checks (peft.py), the slot layout
(stacking.py), the device slots' bookkeeping (slots.py), the known adapters and the host cache
(registry.py), and LoRARequest (request.py). The device side: quant/lora.py (the weight the
layers' einsum adapts) and worker/lora_state.py (slots written on the device)."""

from jaxinfer.lora.peft import Adapter, AdapterError, read_adapter
from jaxinfer.lora.registry import AdapterEntry, AdapterRegistry
from jaxinfer.lora.request import LoRARequest
from jaxinfer.lora.slots import AdapterSlots

__all__ = ["Adapter", "AdapterEntry", "AdapterError", "AdapterRegistry", "AdapterSlots", "LoRARequest", "read_adapter"]
