"""LoRARequest: which adapter a request runs under, as vLLM's API names it (plain Python)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, with the user's integer id for it and its PEFT directory.

    `lora_path` may be empty for an adapter the engine already knows by name (one of
    `lora_modules`, or loaded earlier); a name is one adapter: asking for it with another
    path is refused while it is loaded."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name.strip():
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"LoRARequest.lora_path must be a string, got {self.lora_path!r}")
