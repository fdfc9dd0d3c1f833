"""compressed-tensors checkpoints of a real model written without torch, for benchmarks and the
slow tests (CI has no torch, so no llm-compressor): the weights rounded as llm-compressor's
data-free QuantizationModifier rounds them (a memoryless min-max observer, round to nearest), in
the layout compressed-tensors saves (tests/fixtures/quant/ holds checkpoints llm-compressor
itself wrote; tests/jaxinfer/test_compressed_tensors.py reads both).

    python benchmarks/ct_checkpoint.py W4A16-G64 /tmp/smollm2-w4a16     # from the embedded SmolLM2
    python benchmarks/ct_checkpoint.py W8A8 /tmp/smollm2-w8a8 --model PATH.gguf

Schemes: W4A16-G32 / -G64 / -G128 (int4 symmetric per group, pack-quantized), W8A16 (int8 per
channel, pack-quantized), W8A8 (int8 per channel + dynamic int8 activations per token,
int-quantized), FP8-DYNAMIC (float8 e4m3 per channel + dynamic float8 activations,
float-quantized). The source: an HF directory or a GGUF file (dequantized to float32 as the
loader reads it; rotary rows in HF's order); the LM head is ignored, the embedding stays float.
The tokenizer files of an HF source are copied; a GGUF's vocabulary is written as the tokenizer
transformers builds from it when `--tokenizer-from DIR` names such files (tests/fixtures/smollm2).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SCHEMES = {  # name -> (type, bits, group (0: per channel), activations, format)
    "W4A16-G32": ("int", 4, 32, None, "pack-quantized"),
    "W4A16-G64": ("int", 4, 64, None, "pack-quantized"),
    "W4A16-G128": ("int", 4, 128, None, "pack-quantized"),
    "W8A16": ("int", 8, 0, None, "pack-quantized"),
    "W8A8": ("int", 8, 0, "int", "int-quantized"),
    "FP8-DYNAMIC": ("float", 8, 0, "float", "float-quantized"),
}


def quantize(w: np.ndarray, kind: str, bits: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """[out, in] float32 -> (q [out, in] int8 or float8 values, scales [out, groups or 1] float32):
    symmetric, s = max(|min(w, 0)|, max(w, 0)) / (R / 2) over each group (R = 2^bits - 1; float8:
    896), q = round(clip(w / s, qmin, qmax))."""
    out, n = w.shape
    g = group or n
    grouped = w.reshape(out, n // g, g)
    amax = np.maximum(np.abs(np.minimum(grouped.min(-1), 0)), np.maximum(grouped.max(-1), 0))
    half = np.float32(448.0 if kind == "float" else (2.0**bits - 1) / 2)
    s = (amax / half).astype(np.float32)
    s = np.where(s == 0, np.finfo(np.float32).eps, s).astype(np.float32)
    x = grouped / s[..., None]
    if kind == "float":
        q = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    else:
        q = np.round(np.clip(x, -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)).astype(np.int8)
    return q.reshape(out, n), s


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """int8 [r, n] -> int32 [r, n * bits / 32]: each value plus 2^(bits-1), element i at bit i * bits."""
    u = (q.astype(np.int16) + (1 << (bits - 1))).astype(np.uint8)
    if bits == 4:
        u = (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(u).view("<i4")


def config_groups(name: str) -> dict:
    kind, bits, group, acts, fmt = SCHEMES[name]
    weights = {"num_bits": bits, "type": kind, "symmetric": True, "dynamic": False, "actorder": None}
    weights.update(strategy="group" if group else "channel", group_size=group or None)
    inputs = None
    if acts:
        inputs = {"num_bits": 8, "type": acts, "symmetric": True, "dynamic": True, "strategy": "token"}
    scheme = {"targets": ["Linear"], "weights": weights, "input_activations": inputs, "output_activations": None}
    return {"group_0": {**scheme, "format": fmt}}


def write(tensors: dict[str, np.ndarray], config: dict, dst: Path, name: str) -> Path:
    """HF float tensors + config.json dict -> DST holding the checkpoint quantized as `name`."""
    kind, bits, group, _, fmt = SCHEMES[name]
    out: dict[str, np.ndarray] = {}
    for key, value in tensors.items():
        module = key.removesuffix(".weight")
        if not (key.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEAR):
            out[key] = value
            continue
        q, s = quantize(np.asarray(value, np.float32), kind, bits, group)
        out[f"{module}.weight_scale"] = s.astype(value.dtype)
        if fmt == "pack-quantized":
            out[f"{module}.weight_packed"] = pack(q, bits)
            out[f"{module}.weight_shape"] = np.array(value.shape, np.int64)
        else:
            out[f"{module}.weight"] = q
    dst.mkdir(parents=True, exist_ok=True)
    from safetensors.numpy import save_file

    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    quantization = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": config_groups(name),
        "ignore": ["lm_head"],
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
        "sparsity_config": {},
    }
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}, indent=2))
    return dst


def hf_tensors(source: str | None) -> tuple[dict[str, np.ndarray], dict]:
    """(HF-named float tensors, config.json dict) of an HF directory or a GGUF file (None: the
    embedded default model), the GGUF dequantized and put back in HF's layout."""
    from jaxinfer.loader import default_model_path, open_checkpoint
    from jaxinfer.models.registry import get_family

    path = source or str(default_model_path())
    config, reader, fmt = open_checkpoint(path)
    if fmt == "hf":
        return {k: np.asarray(reader.get(k)) for k in reader.keys()}, json.loads(
            (Path(path) / "config.json").read_text()
        )
    family = get_family(config.family)
    hf = {(s.field, s.layer): s for s in family.checkpoint_specs(config, "hf")}
    tensors = {}
    for spec in family.checkpoint_specs(config, fmt):
        ours = spec.to_ours(np.asarray(reader.get(spec.name), np.float32))
        target = hf[(spec.field, spec.layer)]
        index = target.to_ours(np.arange(int(np.prod(target.ckpt_shape))).reshape(target.ckpt_shape))
        flat = np.empty(index.size, np.float32)
        flat[index.reshape(-1)] = ours.reshape(-1)  # target.to_ours inverted: a permutation
        tensors[target.name] = flat.reshape(target.ckpt_shape)
    return tensors, config.to_hf_dict()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scheme", choices=sorted(SCHEMES))
    p.add_argument("dst")
    p.add_argument("--model", default=None, help="HF directory or GGUF file (default: the embedded SmolLM2)")
    p.add_argument("--tokenizer-from", default=None, help="a directory whose tokenizer files are copied")
    args = p.parse_args(argv)
    tensors, config = hf_tensors(args.model)
    dst = write(tensors, config, Path(args.dst), args.scheme)
    source = Path(args.tokenizer_from) if args.tokenizer_from else Path(args.model or "")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (source / name).is_file():
            shutil.copy(source / name, dst / name)
    print(dst)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
