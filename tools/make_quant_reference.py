"""Writes compressed-tensors checkpoints made by llm-compressor, and HF transformers goldens of
them, under tests/fixtures/quant/, so CI tests the quantized formats without torch.

Run it in an environment with llm-compressor (see tools/README.md, "Quantized checkpoint
fixtures"; llm-compressor pins its own transformers, so it gets a venv of its own):

    /work/refenv-llmc/bin/python tools/make_quant_reference.py

Each fixture quantizes the tiny float32 checkpoint tests/fixtures/hf/llama3 (hidden 64, 8 heads
of 16, MLP 128) with llm-compressor's `oneshot` and one QuantizationModifier scheme (no
calibration data: weight scales come from the weights, activation scales are dynamic), the LM
head ignored, and saves it compressed (`save_pretrained(save_compressed=True)`):

    w4a16_g32        int4 symmetric, groups of 32 inputs        pack-quantized
    w4a16_asym_g32   int4 with zero points, groups of 32         pack-quantized (zero points packed too)
    w4a16_channel    int4 symmetric, one scale per channel       pack-quantized
    w8a16            int8 symmetric per channel                  pack-quantized (4 per int32)
    w8a8             int8 per channel + int8 activations per token, dynamic        int-quantized
    fp8_dynamic      float8 e4m3 per channel + float8 activations per token        float-quantized

and beside each checkpoint golden.npz: `prompt` i32[64] and `logits` f32[64, 512] (one forward
pass of the checkpoint as transformers loads it back, decompressed), `greedy` i32[32] (its
argmax continuation, every step's top-1/top-2 margin >= MIN_MARGIN), and for every quantized
linear weight `sha256:NAME` (the sha256 of the float32 bytes transformers decompressed it to) and
`absmax:NAME`, so a test checks our repacking bit for bit without the weights in the tree.
Deterministic: no randomness past the prompt draw (fixed numpy seed).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_reference as ref  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from llmcompressor import oneshot  # noqa: E402
from llmcompressor.modifiers.quantization import QuantizationModifier  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.utils.quantization_config import CompressedTensorsConfig  # noqa: E402

BASE = ref.HF_DIR / "llama3"
OUT = ref.FIXTURES / "quant"
PROMPT_LEN, NEW_TOKENS = 64, 32


def _int_weights(bits: int, strategy: str, group: int | None = None, symmetric: bool = True) -> QuantizationArgs:
    return QuantizationArgs(
        num_bits=bits, type="int", strategy=strategy, group_size=group, symmetric=symmetric, dynamic=False
    )


def _scheme(weights: QuantizationArgs, acts: QuantizationArgs | None = None) -> QuantizationScheme:
    return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)


SCHEMES = {
    "w4a16_g32": lambda: _scheme(_int_weights(4, "group", 32)),
    "w4a16_asym_g32": lambda: _scheme(_int_weights(4, "group", 32, symmetric=False)),
    "w4a16_channel": lambda: _scheme(_int_weights(4, "channel")),
    "w8a16": lambda: _scheme(_int_weights(8, "channel")),
    "w8a8": "W8A8",
    "fp8_dynamic": "FP8_DYNAMIC",
}


def make(name: str, rng: np.random.Generator) -> list[Path]:
    target = OUT / name
    shutil.rmtree(target, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32)
    scheme = SCHEMES[name]
    if isinstance(scheme, str):
        modifier = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
    else:
        modifier = QuantizationModifier(config_groups={"group_0": scheme()}, ignore=["lm_head"])
    oneshot(model=model, recipe=modifier)
    model.save_pretrained(target, save_compressed=True)
    for extra in ("recipe.yaml", "generation_config.json"):
        (target / extra).unlink(missing_ok=True)
    back = AutoModelForCausalLM.from_pretrained(
        target, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False)
    )
    back.eval()
    ids, greedy = ref.robust_prompt(back, rng, PROMPT_LEN, NEW_TOKENS, name)
    arrays = {"prompt": ids, "logits": ref.forward_logits(back, ids).astype(np.float32), "greedy": greedy}
    quantized = {k for k in _stored_names(target) if k.endswith((".weight_packed", ".weight_scale"))}
    modules = sorted({k.rsplit(".", 1)[0] for k in quantized})
    state = back.state_dict()
    for module in modules:
        w = state[f"{module}.weight"].detach().to(torch.float32).numpy()
        arrays[f"sha256:{module}"] = np.array(hashlib.sha256(np.ascontiguousarray(w).tobytes()).hexdigest())
        arrays[f"absmax:{module}"] = np.float32(np.abs(w).max())
    np.savez(target / "golden.npz", **arrays)
    config = json.loads((target / "config.json").read_text())
    print(f"  {name}: {json.dumps(config['quantization_config']['config_groups'])[:160]} ...")
    return sorted(target.iterdir())


def _stored_names(directory: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(directory / "model.safetensors", "np") as f:
        return list(f.keys())


def main(only: list[str]) -> None:
    torch.set_num_threads(2)
    written = []
    for i, name in enumerate(SCHEMES):
        if only and name not in only:
            continue
        written += make(name, np.random.default_rng(100 + i))
    ref.report(written)
    import compressed_tensors
    import llmcompressor
    import transformers

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"llmcompressor {llmcompressor.__version__}, compressed-tensors {compressed_tensors.__version__}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
