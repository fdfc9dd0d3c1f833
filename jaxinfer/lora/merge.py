"""A checkpoint seen with a LoRA adapter merged into its weights (`jaxinfer convert --lora`).

    reader = MergedReader(reader, adapter)   # HF safetensors: W + scale * B @ A per adapted module

Each targeted module's weight (HF layout [out, in]) is read, the adapter's product added in
float32 and cast back to the checkpoint's dtype, one tensor at a time as the converter reads
them; every other tensor passes through. The embedding [vocab, hidden] gains (B @ A)^T, the LM
head B @ A; with the LM head tied to the embedding (no lm_head.weight) either would change the
other too, so such an adapter is refused by name. The merged checkpoint then computes exactly what the
base model with the adapter computes (up to that cast), with no adapter at run time.
"""

from __future__ import annotations

import re

import numpy as np

from checkpoints.reader import CheckpointReader
from jaxinfer.lora.peft import MODULES, Adapter, AdapterError

_WEIGHT = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.weight$")


class MergedReader:
    def __init__(self, reader: CheckpointReader, adapter: Adapter, where: str = "checkpoint") -> None:
        self._reader = reader
        self._deltas: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for name in reader.keys():
            match = _WEIGHT.search(name)
            if match and match[2] in MODULES and (int(match[1]), match[2]) in adapter.weights:
                a, b = adapter.weights[(int(match[1]), match[2])]
                self._deltas[name] = (a, b * adapter.scale)
        names = set(reader.keys())
        for module, (a, b) in adapter.vocab.items():
            if "lm_head.weight" not in names:
                raise AdapterError(
                    f"{where}: ties its LM head to the embedding, so the adapter's {module} cannot be merged "
                    "(it would change both); serve it as an adapter instead (--lora-modules)"
                )
            name = "model.embed_tokens.weight" if module == "embed_tokens" else "lm_head.weight"
            self._deltas[name] = (b.T * adapter.scale, a.T) if module == "embed_tokens" else (a, b * adapter.scale)
        if len(self._deltas) != len(adapter.weights) + len(adapter.vocab):
            raise AdapterError(
                f"{where}: found the weights of {len(self._deltas)} of the adapter's "
                f"{len(adapter.weights) + len(adapter.vocab)} modules (an HF Llama-style checkpoint names them "
                "model.layers.N.self_attn.q_proj.weight, ...)"
            )

    def keys(self) -> list[str]:
        return self._reader.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return self._reader.shape(name)

    def get(self, name: str) -> np.ndarray:
        w = self._reader.get(name)
        if name not in self._deltas:
            return w
        a, b = self._deltas[name]
        return (w.astype(np.float32) + b @ a).astype(w.dtype)

    @property
    def num_merged(self) -> int:
        return len(self._deltas)
