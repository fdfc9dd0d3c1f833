"""compressed-tensors weights (quant/schemes.py says which scheme each module has) read into
QuantizedWeight, kept quantized:

    NAME.weight_packed i32 [out, in * bits / 32]   4 / 8-bit integers packed densely, element i at
                                                   bit i * bits (little-endian words), each stored
                                                   plus 2^(bits-1); the zero points alike along out
    NAME.weight        int8 or float8 e4m3 [out, in]
    NAME.weight_scale  [out, in / group], [out, 1] (channel) or [1] (tensor), in the model dtype
    NAME.weight_zero_point (asymmetric): as the scales, int8; packed [out * bits / 32, groups]

and w = (q - z) * s in the scales' dtype, as compressed-tensors' own `dequantize` computes it.
int4 keeps its stored (offset) integers 0..15 with zero points z + 8 (8 where symmetric); int8
its signed integers (zero points only where asymmetric); float8 its values. The checkpoint's
[out, in] layout goes to ours as a GGUF tensor's does (quant/gguf.py `repack`: the family's
`to_ours` applied to an index array), or, with one scale per output channel, with each scale
following its channel. A layout that splits a group comes back None: the loader dequantizes it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np
from jax.typing import DTypeLike

from jaxinfer.quant import gptq_awq, schemes
from jaxinfer.quant.gguf import is_permutation, repack
from jaxinfer.quant.gguf_blocks import Blocks
from jaxinfer.quant.nibbles import pack_int4
from jaxinfer.quant.quantize import unpack_words
from jaxinfer.quant.schemes import StoredQuantization, WeightScheme
from jaxinfer.quant.weights import QuantizedWeight

if TYPE_CHECKING:
    from jaxinfer.quant.config import StoredSpec

logger = logging.getLogger(__name__)

Reader = Any  # a checkpoint reader: keys(), shape(name), get(name)


def module_of(weight_name: str) -> str:
    """ "model.layers.0.mlp.up_proj.weight" -> "model.layers.0.mlp.up_proj"."""
    return weight_name.removesuffix(".weight")


def _scale_shape(scheme: WeightScheme, out: int, inputs: int) -> tuple[int, ...]:
    return {"group": (out, inputs // max(scheme.group, 1)), "channel": (out, 1), "tensor": (1,)}[scheme.strategy]


def stored_shapes(scheme: WeightScheme, module: str, shape: tuple[int, ...], where: str) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} a module of float shape [out, in] is stored as; a group size that does
    not divide `in` is refused here, naming the module."""
    if len(shape) != 2:
        raise ValueError(f"{where}: {module} is stored quantized, but its weight {shape} is not 2-D [out, in]")
    out, inputs = shape
    if scheme.group and inputs % scheme.group:
        raise ValueError(
            f"{where}: {module}: group_size={scheme.group} does not divide its {inputs} inputs (weight {tuple(shape)})"
        )
    if scheme.format in ("gptq", "gptq_v2", "awq"):
        return gptq_awq.stored_shapes(scheme, module, out, inputs)
    scale = _scale_shape(scheme, out, inputs)
    if scheme.format == "pack-quantized":
        shapes = {
            f"{module}.weight_packed": (out, -(-inputs * scheme.bits // 32)),
            f"{module}.weight_shape": (2,),
            f"{module}.weight_scale": scale,
        }
        if not scheme.symmetric:
            shapes[f"{module}.weight_zero_point"] = (-(-scale[0] * scheme.bits // 32), *scale[1:])
        return shapes
    shapes = {f"{module}.weight": (out, inputs), f"{module}.weight_scale": scale}
    if not scheme.symmetric:
        shapes[f"{module}.weight_zero_point"] = scale
    return shapes


def _unpacked(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """i32 [r, words] -> uint8 [r, n]: the stored (offset) integers, element i at bit i * bits."""
    return unpack_words(packed, bits).reshape(packed.shape[0], -1)[:, :n]


def decode(reader: Reader, module: str, scheme: WeightScheme, shape: tuple[int, int], where: str) -> Blocks:
    """A module's stored tensors -> integers (or float8 values) [out, in] and per-group arrays
    [out, groups] (one group per row with channel / tensor scales), in the checkpoint's layout."""
    out, inputs = shape
    scales = np.asarray(reader.get(f"{module}.weight_scale"))
    scales = np.broadcast_to(scales.reshape(-1, 1) if scales.size == 1 else scales, (out, scales.shape[-1])).copy()
    zeros = None
    if scheme.format == "pack-quantized":
        stored = tuple(int(n) for n in np.asarray(reader.get(f"{module}.weight_shape")).reshape(-1))
        if stored != (out, inputs):
            raise ValueError(f"{where}: {module}.weight_shape={list(stored)} is not the model's {[out, inputs]}")
        q = _unpacked(np.asarray(reader.get(f"{module}.weight_packed")), scheme.bits, inputs)
        if not scheme.symmetric:
            packed = np.asarray(reader.get(f"{module}.weight_zero_point"))
            zeros = np.ascontiguousarray(_unpacked(packed.T, scheme.bits, scales.shape[0]).T)
        if scheme.bits == 8:  # signed, the offset taken off (zero points alike)
            q = (q.astype(np.int16) - 128).astype(np.int8)
            zeros = None if zeros is None else (zeros.astype(np.int16) - 128).astype(np.int8)
        elif zeros is None:
            zeros = np.full(scales.shape, 8, np.uint8)
    else:
        q = np.asarray(reader.get(f"{module}.weight"))
        want = np.int8 if scheme.kind == "int" else ml_dtypes.float8_e4m3fn
        if q.dtype != want:
            raise ValueError(f"{where}: {module}.weight is {q.dtype}, but its scheme stores {np.dtype(want)}")
        if not scheme.symmetric:
            zp = np.asarray(reader.get(f"{module}.weight_zero_point"))
            zeros = np.broadcast_to(zp.reshape(-1, 1) if zp.size == 1 else zp, scales.shape).astype(np.int8)
    group = scheme.group or inputs
    return Blocks(q, scales, zeros, None, group, 4 if scheme.bits == 4 and scheme.kind == "int" else 8)


def to_ours(
    blocks: Blocks,
    to_ours_fn: Callable[[np.ndarray], np.ndarray],
    inputs: tuple[int, ...],
    per_channel: bool,
    dtype: DTypeLike,
    activations: tuple[str, str] | None,
) -> QuantizedWeight | None:
    """The decoded module in our layout: grouped as GGUF blocks are (repack), or with one scale
    per output channel (group 0), each scale following its channel."""
    method = "fp8" if blocks.integers.dtype == ml_dtypes.float8_e4m3fn else None
    if not per_channel:
        w = repack(blocks, to_ours_fn, inputs, dtype)
        return None if w is None else _finish(w, method, activations)
    shape, n_in = blocks.integers.shape, blocks.integers.shape[-1]
    size = int(np.prod(shape))
    index = to_ours_fn(np.arange(size, dtype=np.int64).reshape(shape))
    if not is_permutation(index, size):
        return None
    row = index // n_in  # the output channel of each weight, in our layout
    first = row[tuple(slice(0, 1) if i in inputs else slice(None) for i in range(row.ndim))]
    if not np.all(row == first):
        return None
    take = lambda a: None if a is None else np.ascontiguousarray(a[:, 0][first])  # noqa: E731
    q = blocks.integers.reshape(-1)[index]
    values = pack_int4(q, inputs[-1]) if blocks.bits == 4 else np.ascontiguousarray(q)
    kind = method or ("int4" if blocks.bits == 4 else "int8")
    return QuantizedWeight(values, take(blocks.scales), take(blocks.zeros), kind, inputs, 0, None, dtype, activations)


def _finish(w: QuantizedWeight, method: str | None, activations: tuple[str, str] | None) -> QuantizedWeight:
    return QuantizedWeight(
        w.values, w.scales, w.zeros, method or w.method, w.inputs, w.group, w.offsets, w.dtype, activations
    )


def stored_quantization(directory: Path | None, where: str) -> StoredQuantization | None:
    """The quantization an HF checkpoint directory's config.json says its weights are stored in
    (or, for AutoGPTQ's older checkpoints, its quantize_config.json: a GPTQ config)."""
    path = None if directory is None else Path(directory) / "config.json"
    if path is None or not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None  # the config's own reader names the problem
    found = config.get("quantization_config") if isinstance(config, dict) else None
    legacy = path.with_name("quantize_config.json")
    if not found and legacy.is_file():
        try:
            found = {"quant_method": "gptq", **json.loads(legacy.read_text())}
        except (json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"{legacy}: not a JSON object ({e})") from None
        where = str(legacy)
    return schemes.parse(found, where)


def expected_specs[S: StoredSpec](specs: list[S], stored: StoredQuantization, linear: set[str], where: str) -> list[S]:
    """The checkpoint tensors `specs` stand for: each quantized module's stored tensors (names and
    shapes) in place of its float weight, so one check names every missing or misshaped one."""
    out: list[S] = []
    for spec in specs:
        scheme = stored.scheme_for(module_of(spec.name)) if spec.field in linear else None
        if scheme is None:
            out.append(spec)
            continue
        shapes = stored_shapes(scheme, module_of(spec.name), spec.ckpt_shape, where)
        out += [dataclasses.replace(spec, name=name, ckpt_shape=shape) for name, shape in shapes.items()]
    return out


def read_module(
    reader: Reader,
    spec: StoredSpec,
    inputs: tuple[int, ...],
    scheme: WeightScheme,
    dtype: DTypeLike,
    keep: bool,
    where: str,
) -> QuantizedWeight | np.ndarray:
    """One quantized module as our field: kept quantized (`keep`, in a layout ours can hold), else
    dequantized to `dtype` on the host (float, in our layout)."""
    module = module_of(spec.name)
    shape = spec.ckpt_shape
    g_idx = None
    if scheme.format in ("gptq", "gptq_v2", "awq"):
        blocks, g_idx = gptq_awq.decode(reader, module, scheme, (shape[0], shape[1]))
    else:
        blocks = decode(reader, module, scheme, (shape[0], shape[1]), where)
    activations = None if scheme.activations is None else (scheme.activations, scheme.activations_per)
    if g_idx is not None and keep:  # act-order: input rows sorted into runs of a group each
        w = _act_order(blocks, g_idx, spec.to_ours, inputs, dtype)
        if w is not None:
            return w
    if g_idx is not None:
        logger.info("%s: act-order groups that do not sort into runs are dequantized at load", module)
        return np.ascontiguousarray(spec.to_ours(dequantized(blocks, g_idx)).astype(dtype))
    if keep:
        w = to_ours(blocks, spec.to_ours, inputs, not scheme.group, dtype, activations)
        if w is not None:
            return w
        logger.info("%s (%s) does not fit a quantized layout of ours: dequantized", module, scheme.name())
    return np.ascontiguousarray(spec.to_ours(dequantized(blocks)).astype(dtype))


def dequantized(blocks: Blocks, g_idx: np.ndarray | None = None) -> np.ndarray:
    """[out, in] decoded -> (q - z) * s in float32, where each product of a small integer and a
    (float16, bfloat16 or float32) scale is exact: rounded once to a dtype, it is what computing
    in that dtype gives (compressed-tensors' `dequantize` computes in the scales' dtype).
    `g_idx`: the group of each input (GPTQ act-order), else runs of `group` inputs."""
    n = blocks.integers.shape[1]
    groups = np.arange(n) // blocks.group if g_idx is None else g_idx
    per_weight = lambda a: a.astype(np.float32)[:, groups]  # noqa: E731
    q = blocks.integers.astype(np.float32)
    if blocks.zeros is not None:
        q = q - per_weight(blocks.zeros)
    return q * per_weight(blocks.scales)


def _act_order(
    blocks: Blocks,
    g_idx: np.ndarray,
    to_ours_fn: Callable[[np.ndarray], np.ndarray],
    inputs: tuple[int, ...],
    dtype: DTypeLike,
) -> QuantizedWeight | None:
    """GPTQ act-order kept quantized (quant/act_order.py): the input rows sorted by group, so each
    group is a run of `group` rows again, and the order kept as the weight's `perm`; None where
    the groups do not sort into equal runs or our layout does not keep the inputs' order."""
    out, n = blocks.integers.shape
    perm = np.argsort(g_idx, kind="stable")
    if not np.array_equal(g_idx[perm], np.arange(n) // blocks.group) or inputs != tuple(range(len(inputs))):
        return None
    order = to_ours_fn(np.broadcast_to(np.arange(n), (out, n)).copy())  # each weight's input, in our layout
    first = order[(slice(None),) * len(inputs) + (slice(0, 1),) * (order.ndim - len(inputs))]
    if not (np.array_equal(first.reshape(-1), np.arange(n)) and np.all(order == first)):
        return None
    sorted_blocks = Blocks(blocks.integers[:, perm], blocks.scales, blocks.zeros, None, blocks.group, blocks.bits)
    w = to_ours(sorted_blocks, to_ours_fn, inputs, False, dtype, None)
    return None if w is None else w.with_perm(perm.astype(np.int32))
