"""Input activations quantized on the fly, as W8A8 (int8) and FP8_DYNAMIC (float8 e4m3)
checkpoints were calibrated to see them (compressed-tensors' dynamic symmetric scheme):

    per token (or per tensor): s = max|x| / R over the features a linear layer contracts
    int8: R = 127.5, x_q = round(clip(x / s, -128, 127))       fp8: R = 448, x_q = e4m3(clip(x / s, -448, 448))
    x ~ x_q * s   (a zero max gives s = the dtype's epsilon; the largest |x| lands on +-R, and
                   int8 rounds -127.5 to -128 as round-half-to-even does)

`fake_quantized` returns x_q * s in x's dtype, what the layer then multiplies by its weight: the
output every backend computes. Where the backend multiplies the quantized operands themselves
(MATMUL_BACKENDS: int8 on TPUs, float8 on NVIDIA GPUs), a per-channel int8 (fp8) weight whose
inputs are quantized alike runs as one such matmul (`quantized_matmul`): sums in int32 (float32),
scaled by s and the weight's column scales after, the same products without the rounding of
x_q * s.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

QuantizedWeight = Any  # quant/weights.py's, which imports this module (annotated loosely: no cycle)
RANGES = {"int8": (127.5, -128.0, 127.0), "fp8": (448.0, -448.0, 448.0)}
# Where a matmul runs on the quantized operands themselves (int8 x int8 into int32 on TPU v5e /
# v6e; float8 x float8 into float32 on NVIDIA's FP8 tensor cores, H100 / H200, to be measured in
# the GPU issue's list); elsewhere the float form below.
MATMUL_BACKENDS = {"int8": ("tpu",), "fp8": ("gpu",)}


def _contracted(spec: str) -> tuple[str, str, str, str]:
    """(x letters, w letters, out letters, contracted letters) of "x,w->out"."""
    operands, out = spec.split("->")
    x_letters, w_letters = operands.split(",")
    return x_letters, w_letters, out, "".join(c for c in x_letters if c in w_letters and c not in out)


def _scaled(spec: str, x: jax.Array, kind: str, per: str) -> tuple[jax.Array, jax.Array]:
    """(x / s clipped and rounded to the kind's grid, still in x's dtype; s, kept for broadcast)."""
    x_letters, _, _, contracted = _contracted(spec)
    axes = tuple(range(x.ndim)) if per == "tensor" else tuple(x_letters.index(c) for c in contracted)
    r, lo, hi = RANGES[kind]
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
    s = amax / jnp.asarray(r, x.dtype)
    s = jnp.where(s == 0, jnp.asarray(jnp.finfo(x.dtype).eps, x.dtype), s)
    clipped = jnp.clip(x / s, lo, hi)
    if kind == "fp8":
        return clipped.astype(jnp.float8_e4m3fn).astype(x.dtype), s
    # Each token's largest |x| sits on +-127.5 exactly: +127.5 clips to 127, -127.5 is a tie
    # rounded to even (-128). x / s may land an ulp either side of it (XLA:CPU's division is not
    # IEEE-exact, nor is torch's result at that tie), so -128 is set, as exact arithmetic gives.
    return jnp.where((x == -amax) & (amax > 0), jnp.asarray(lo, x.dtype), jnp.round(clipped)), s


def fake_quantized(spec: str, x: jax.Array, activations: tuple[str, str]) -> jax.Array:
    """x quantized and dequantized per token (or tensor) over the axes `spec` contracts."""
    kind, per = activations
    q, s = _scaled(spec, x, kind, per)
    return q * s


def uses_quantized_matmul(w: QuantizedWeight) -> bool:
    """Whether `w` (per-channel int8 / fp8 with its inputs quantized alike) multiplies as stored
    on this backend."""
    if w.activations is None or w.activations[0] != w.method or not w.per_channel_int8:
        return False
    return jax.default_backend() in MATMUL_BACKENDS[w.method]  # per_channel_int8: int8 or fp8


def quantized_matmul(spec: str, x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """jnp.einsum(spec, x, w) with x quantized per token as w's inputs are and w per channel:
    the products summed in int32 (int8) or float32 (fp8) on the stored operands, then scaled by
    each token's s and each output column's weight scale."""
    assert w.activations is not None
    q, s = _scaled(spec, x, w.method, w.activations[1])
    x_letters, w_letters, out, _ = _contracted(spec)
    stored, acc = (jnp.int8, jnp.int32) if w.method == "int8" else (jnp.float8_e4m3fn, jnp.float32)
    y = jnp.einsum(spec, q.astype(stored), w.values, preferred_element_type=acc).astype(x.dtype)
    w_out = "".join(c for i, c in enumerate(w_letters) if i not in w.inputs)
    free = "".join(c for c in x_letters if c in out)
    assert out == free + w_out, spec  # the linear layers' form: x's free axes, then w's outputs
    y = jnp.einsum(f"{out},{w_out}->{out}", y, jnp.squeeze(w.scales, w.inputs).astype(x.dtype))
    s_free = s.reshape([n for c, n in zip(x_letters, s.shape) if c in out] + [1] * len(w_out))
    return y * s_free
