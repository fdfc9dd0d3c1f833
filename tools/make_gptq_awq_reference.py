"""Writes GPTQ and AWQ checkpoints packed by the formats' own library (GPTQModel), and HF
transformers goldens of them, under tests/fixtures/quant/, so CI tests both formats without torch.

Run it in the llm-compressor environment with GPTQModel added (see tools/README.md, "Quantized
checkpoint fixtures"):

    /work/refenv-llmc/bin/python tools/make_gptq_awq_reference.py

Each fixture rounds the linear weights of the tiny float32 checkpoint tests/fixtures/hf/llama3
to nearest (per group of inputs, or per output channel), then packs them with GPTQModel's own
packers into the layout its checkpoints hold, the LM head left float:

    gptq_g32           4-bit symmetric, groups of 32, checkpoint_format gptq (v1: zero points
                       stored minus one, GPTQModel's own v2 -> v1 conversion)
    gptq_g32_asym      4-bit with zero points, groups of 32, v1
    gptq_actorder      4-bit with zero points, groups of 32, desc_act: each layer's inputs taken
                       in a random order (g_idx: the group of each input row, not monotonic),
                       one order for the modules that read the same inputs (q, k, v; gate, up)
    gptq_v2_g32_asym   as gptq_g32_asym, checkpoint_format gptq_v2 (zero points as they are)
    gptq_8bit_channel  8-bit symmetric, one scale per output channel (group_size -1)
    awq_g32            AutoAWQ GEMM: 4-bit with zero points, groups of 32 (GPTQModel's pack_awq)

Beside each: golden.npz with `prompt` i32[64], `logits` f32[64, 512] and `greedy` i32[32] (every
step's top-1/top-2 margin >= MIN_MARGIN) of HF transformers' LlamaForCausalLM holding the weights
the library unpacks (GPTQModel's dequantize_weight / dequantize_gemm, computed in float32: each
product of an integer and a float16 scale is exact there), and per quantized module
`sha256:NAME` of those float32 weights [out, in]. Deterministic (fixed seeds).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_reference as ref  # noqa: E402
from gptqmodel.nn_modules.qlinear.torch import TorchLinear  # noqa: E402
from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm, pack_awq  # noqa: E402
from gptqmodel.utils.model import convert_gptq_v2_to_v1_format_module  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

BASE = ref.HF_DIR / "llama3"
OUT = ref.FIXTURES / "quant"
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FIXTURES = {  # name -> (method, bits, group (-1: per channel), symmetric, act-order, checkpoint_format)
    "gptq_g32": ("gptq", 4, 32, True, False, "gptq"),
    "gptq_g32_asym": ("gptq", 4, 32, False, False, "gptq"),
    "gptq_actorder": ("gptq", 4, 32, False, True, "gptq"),
    "gptq_v2_g32_asym": ("gptq", 4, 32, False, False, "gptq_v2"),
    "gptq_8bit_channel": ("gptq", 8, -1, True, False, "gptq"),
    "awq_g32": ("awq", 4, 32, False, False, "gemm"),
}


def rtn(w: torch.Tensor, bits: int, group: int, sym: bool, order: torch.Tensor):
    """w [out, in] -> (scales [groups, out], zeros [groups, out], g_idx [in]): groups of `group`
    inputs taken in `order` (act-order), min-max rounding; symmetric: zero 2^(bits-1)."""
    out, n = w.shape
    g = n if group == -1 else group
    maxq = 2**bits - 1
    g_idx = torch.empty(n, dtype=torch.int32)
    g_idx[order] = torch.arange(n, dtype=torch.int32) // g
    cols = w[:, order].reshape(out, n // g, g)
    lo, hi = cols.amin(-1).clamp(max=0), cols.amax(-1).clamp(min=0)
    if sym:
        amax = torch.maximum(lo.abs(), hi)
        scales = (2 * amax / maxq).clamp(min=1e-8)
        zeros = torch.full_like(scales, (maxq + 1) // 2)
    else:
        scales = ((hi - lo) / maxq).clamp(min=1e-8)
        zeros = torch.round(-lo / scales).clamp(0, maxq)
    return scales.T.contiguous().half(), zeros.T.contiguous().int(), g_idx


def gptq_module(w, bits, group, sym, desc_act, fmt, order):
    n = w.shape[1]
    order = torch.from_numpy(order) if desc_act else torch.arange(n)
    scales, zeros, g_idx = rtn(w, bits, group, sym, order)
    linear = torch.nn.Linear(n, w.shape[0], bias=False)
    linear.weight.data = w.clone()
    q = TorchLinear(bits=bits, group_size=group, sym=sym, desc_act=desc_act, in_features=n, out_features=w.shape[0])
    q.pack(linear, scales.T.contiguous(), zeros.T.contiguous(), g_idx)  # it takes [out, groups]
    q.scales = q.scales.float()  # unpacked in float32: the exact products
    unpacked = q.dequantize_weight().T.contiguous().float()  # [out, in]
    q.scales = q.scales.half()
    if fmt == "gptq":
        convert_gptq_v2_to_v1_format_module(q, types.SimpleNamespace(bits=bits, pack_dtype=torch.int32))
    tensors = {"qweight": q.qweight, "qzeros": q.qzeros, "scales": q.scales, "g_idx": q.g_idx.int()}
    return tensors, unpacked


def awq_module(w, bits, group, rng):
    scales, zeros, _ = rtn(w, bits, group, False, torch.arange(w.shape[1]))
    g = group
    ints = torch.round(w / scales.T.float().repeat_interleave(g, 1)) + zeros.T.repeat_interleave(g, 1)
    ints = ints.clamp(0, 2**bits - 1).int().T.contiguous()  # [in, out]
    qweight, qzeros = pack_awq(ints, zeros, bits)
    unpacked = dequantize_gemm(qweight, qzeros, scales.float(), bits, g).T.contiguous().float()
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales}, unpacked


def make(name: str, seed: int) -> list[Path]:
    method, bits, group, sym, desc_act, fmt = FIXTURES[name]
    target = OUT / name
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    model = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32)
    rng = np.random.default_rng(seed)
    tensors, arrays, orders = {}, {}, {}
    for key, value in model.state_dict().items():
        module = key.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] not in LINEAR:
            tensors[key] = value.contiguous()
            continue
        if method == "gptq":
            # act-order visits a layer's inputs by its Hessian's diagonal: modules reading the
            # same inputs (q, k, v; gate, up) share the order
            shared = module.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
            order = orders.setdefault(shared, rng.permutation(value.shape[1]))
            parts, unpacked = gptq_module(value.float(), bits, group, sym, desc_act, fmt, order)
        else:
            parts, unpacked = awq_module(value.float(), bits, group, rng)
        tensors.update({f"{module}.{k}": v.contiguous() for k, v in parts.items()})
        model.get_submodule(module).weight.data = unpacked
        arrays[f"sha256:{module}"] = np.array(hashlib.sha256(unpacked.numpy().tobytes()).hexdigest())
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((BASE / "config.json").read_text())
    if method == "gptq":
        quant = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym}
        quant.update(checkpoint_format=fmt, true_sequential=True, lm_head=False)
    else:
        quant = {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": fmt}
        quant["modules_to_not_convert"] = None
    (target / "config.json").write_text(json.dumps({**config, "quantization_config": quant}, indent=2) + "\n")
    model.eval()
    ids, greedy = ref.robust_prompt(model, np.random.default_rng(200 + seed), 64, 32, name)
    arrays.update(prompt=ids, logits=ref.forward_logits(model, ids).astype(np.float32), greedy=greedy)
    np.savez(target / "golden.npz", **arrays)
    return sorted(target.iterdir())


def main(only: list[str]) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    written = []
    for i, name in enumerate(FIXTURES):
        if not only or name in only:
            written += make(name, 10 + i)
    ref.report(written)
    import gptqmodel
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, gptqmodel {gptqmodel.__version__}")


if __name__ == "__main__":
    main(sys.argv[1:])
