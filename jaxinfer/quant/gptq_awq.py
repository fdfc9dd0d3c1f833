"""GPTQ and AWQ checkpoints' packed tensors -> integers, scales and zero points in the
checkpoint's [out, in] layout (quant/compressed.py then repacks them as it does compressed-tensors'):

    GPTQ (AutoGPTQ / GPTQModel; HF quant_method "gptq"), a linear module NAME [out, in]:
      NAME.qweight  i32 [in * bits / 32, out]   32 / bits consecutive input rows per word, low bits first
      NAME.qzeros   i32 [groups, out * bits / 32]  zero points, packed along out the same way
      NAME.scales   f16 [groups, out]
      NAME.g_idx    i32 [in]                    the group of each input row (act-order: any order)
      w[o, i] = (q[i, o] - z[g_idx[i], o]) * s[g_idx[i], o]; checkpoint_format "gptq" (v1) stores
      each zero point minus one (the word plus 0x11111111 gives z), "gptq_v2" stores z.
    AWQ (AutoAWQ GEMM; quant_method "awq"):
      NAME.qweight  i32 [in, out / 8]   8 output columns per word, column c * 8 + ORDER[k] in nibble k
      NAME.qzeros   i32 [in / group, out / 8]   packed alike
      NAME.scales   f16 [in / group, out]
      w[o, i] = (q[i, o] - z[i // group, o]) * s[i // group, o]

Symmetric 8-bit GPTQ (every zero point 128) becomes signed int8 without zero points, the layout
the per-channel int8 matmul takes. Act-order (g_idx not i // group) keeps groups that are not
runs of inputs: `decode` returns the g_idx, and the loader dequantizes such a module.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxinfer.quant.gguf_blocks import Blocks
from jaxinfer.quant.quantize import unpack_words
from jaxinfer.quant.schemes import WeightScheme

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column (within 8) each nibble holds
AWQ_UNORDER = tuple(int(i) for i in np.argsort(AWQ_ORDER))
# GPTQ v1 -> v2 zero points: one added to every packed value as one int32 addition (the word's
# carries included), as GPTQModel converts them.
V1_OFFSET = {4: 0x11111111, 8: 0x01010101}


def stored_shapes(scheme: WeightScheme, module: str, out: int, inputs: int) -> dict[str, tuple[int, ...]]:
    groups = inputs // scheme.group if scheme.group else 1
    per_word = 32 // scheme.bits
    if scheme.format == "awq":
        return {
            f"{module}.qweight": (inputs, out // per_word),
            f"{module}.qzeros": (groups, out // per_word),
            f"{module}.scales": (groups, out),
        }
    return {
        f"{module}.qweight": (inputs // per_word, out),
        f"{module}.qzeros": (groups, -(-out // per_word)),
        f"{module}.scales": (groups, out),
        f"{module}.g_idx": (inputs,),
    }


def decode(reader: Any, module: str, scheme: WeightScheme, shape: tuple[int, int]) -> tuple[Blocks, np.ndarray | None]:
    """(integers [out, in], scales / zeros [out, groups]) of a GPTQ or AWQ module, and its g_idx
    where the groups are not runs of consecutive inputs (act-order), else None."""
    out, inputs = shape
    bits, group = scheme.bits, scheme.group or inputs
    scales = np.asarray(reader.get(f"{module}.scales"))
    qweight, qzeros = np.asarray(reader.get(f"{module}.qweight")), np.asarray(reader.get(f"{module}.qzeros"))
    if scheme.format == "awq":
        q = unpack_words(qweight, bits)[..., AWQ_UNORDER].reshape(inputs, out)
        zeros = unpack_words(qzeros, bits)[..., AWQ_UNORDER].reshape(scales.shape).astype(np.int16)
        g_idx = None
    else:
        q = unpack_words(qweight, bits).transpose(0, 2, 1).reshape(inputs, out)  # word rows -> input rows
        if scheme.format == "gptq":  # v1: each zero point stored minus one, borrowing across the word
            qzeros = ((qzeros.astype(np.int64) + V1_OFFSET[bits]) & 0xFFFFFFFF).astype(np.uint32).view(np.int32)
        zeros = unpack_words(qzeros, bits).reshape(scales.shape[0], -1)[:, :out].astype(np.int16)
        g_idx = np.asarray(reader.get(f"{module}.g_idx")).astype(np.int64)
        if g_idx.min() < 0 or g_idx.max() >= scales.shape[0]:
            raise ValueError(f"{module}.g_idx names groups outside 0..{scales.shape[0] - 1}")
        g_idx = None if np.array_equal(g_idx, np.arange(inputs) // group) else g_idx
    q, zeros, scales = np.ascontiguousarray(q.T), np.ascontiguousarray(zeros.T), np.ascontiguousarray(scales.T)
    if bits == 8:  # signed, as our int8 holds them; symmetric (all 128) needs no zero points
        q = (q.astype(np.int16) - 128).astype(np.int8)
        zeros = zeros - 128
        return Blocks(q, scales, None if not zeros.any() else zeros, None, group, 8), g_idx
    return Blocks(q, scales, zeros.astype(np.uint8), None, group, 4), g_idx
