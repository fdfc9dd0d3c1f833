"""LoraConfig: serving LoRA adapters over the base model -- device slots, their rank, the host cache.

    EngineConfig(enable_lora=True, max_loras=4, max_lora_rank=16, lora_modules=["sql=/adapters/sql"])

`max_loras` adapters sit on the device at once (each in a slot of the stacked A/B arrays every
targeted linear carries, padded to `max_lora_rank`: quant/lora.py), so a batch mixes requests of
up to that many adapters and of none; `max_cpu_loras` more are kept read in host memory (least
recently used first out). `lora_modules` are adapters known from start-up, by name (naming any turns
`enable_lora` on); the Python API and both servers can name others by path (jaxinfer/lora/).
`lora_target_modules` are the modules the slots hold (each costs memory and every step's reading
of it): by default the seven linear modules of every decoder layer, and the embedding and the LM
head where an adapter named at start-up adapts them; an adapter of a module not held is refused.
`specialize_lora` (on by default) compiles each step variant twice, with the adapters' shares and
without them: a step where no token has an adapter runs the base model alone (vLLM's
`cudagraph_specialize_lora`); off, one variant computes the shares in every step.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxinfer.config.checks import bad, bools, positive_ints
from jaxinfer.options import DISABLE, ENABLE, LIST, option

# PEFT's names of the modules an adapter may adapt (jaxinfer/lora/peft.py)
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VOCAB_MODULES = ("embed_tokens", "lm_head")
TARGET_MODULES = (*LINEAR_MODULES, *VOCAB_MODULES)
LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class LoraModule:
    """An adapter named at start-up: `name=path`, or vLLM's JSON {"name": ..., "path": ...}."""

    name: str
    path: str

    @classmethod
    def parse(cls, text: Any) -> LoraModule:
        if isinstance(text, LoraModule):
            return text
        if isinstance(text, str) and text.lstrip().startswith("{"):
            try:
                spec = json.loads(text)
            except json.JSONDecodeError as e:
                raise bad("lora_modules", text, f"not valid JSON ({e.msg})") from None
            if (
                not isinstance(spec, dict)
                or not isinstance(spec.get("name"), str)
                or not isinstance(spec.get("path"), str)
            ):
                raise bad("lora_modules", text, 'expected {"name": NAME, "path": PATH}')
            name, path = spec["name"], spec["path"]
        elif isinstance(text, str) and "=" in text:
            name, path = text.split("=", 1)
        else:
            raise bad("lora_modules", text, "expected NAME=PATH or a JSON object with name and path")
        if not name.strip() or not path.strip():
            raise bad("lora_modules", text, "the adapter's name and path must not be empty")
        return cls(name.strip(), path.strip())


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (PEFT format) served over the base model, many in one batch."""

    TITLE = "LoRA adapters"

    enable_lora: bool = option(False, "serve LoRA adapters over the base model", form=ENABLE)
    max_loras: int = option(4, "LoRA adapters on the device at once (one batch mixes up to this many)")
    max_lora_rank: int = option(16, "largest LoRA rank served (the device slots' rank)")
    max_cpu_loras: int | None = option(None, "LoRA adapters kept in host memory (default: max_loras)")
    lora_modules: tuple[LoraModule, ...] = option(
        (),
        "LoRA adapters known from start-up, NAME=PATH (a PEFT directory) or JSON; several may follow",
        form=LIST,
        metavar="NAME=PATH",
    )
    lora_target_modules: tuple[str, ...] | None = option(
        None,
        "modules the LoRA slots hold, 'all' or of " + " ".join(TARGET_MODULES) + " (default: the seven linear "
        "modules, and embed_tokens / lm_head where an adapter of lora_modules adapts them)",
        form=LIST,
        metavar="MODULE",
    )

    lora_dtype: str = option(
        "auto",
        "dtype of the LoRA slots: auto (the model's), float32, bfloat16 or float16; narrower slots are read "
        "in fewer bytes, their products accumulated in float32",
        choices=LORA_DTYPES,
    )
    specialize_lora: bool = option(
        True,
        "compile one LoRA step variant for every variant: steps with adapters compute their shares, steps "
        "without run the base model alone (the default compiles each variant twice)",
        form=DISABLE,
        flag="--no-specialize-lora",
    )

    def __post_init__(self):
        bools(self, "enable_lora", "specialize_lora")
        positive_ints(self, "max_loras", "max_lora_rank", "max_cpu_loras")
        if self.lora_dtype not in LORA_DTYPES:
            raise bad("lora_dtype", self.lora_dtype, f"expected one of {', '.join(LORA_DTYPES)}")
        if not isinstance(self.lora_modules, (list, tuple)):
            raise bad("lora_modules", self.lora_modules, "expected a list of NAME=PATH")
        modules = tuple(LoraModule.parse(m) for m in self.lora_modules)
        object.__setattr__(self, "lora_modules", modules)
        names = [m.name for m in modules]
        if len(set(names)) != len(names):
            raise bad("lora_modules", names, "an adapter name is given twice")
        if modules and not self.enable_lora:  # naming adapters turns LoRA on
            object.__setattr__(self, "enable_lora", True)
        if self.lora_target_modules is not None:
            targets = self.lora_target_modules
            if isinstance(targets, str) or not all(isinstance(m, str) for m in targets):
                raise bad("lora_target_modules", targets, "expected a list of module names")
            unknown = [m for m in targets if m not in (*TARGET_MODULES, "all")]
            if unknown or not targets:
                raise bad(
                    "lora_target_modules", list(targets), f"expected 'all' or names among {', '.join(TARGET_MODULES)}"
                )
            held = TARGET_MODULES if "all" in targets else tuple(m for m in TARGET_MODULES if m in targets)
            object.__setattr__(self, "lora_target_modules", held)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise bad("max_cpu_loras", self.max_cpu_loras, f"must be at least max_loras={self.max_loras}")

    @property
    def host_capacity(self) -> int:
        """Adapters kept read in host memory."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
