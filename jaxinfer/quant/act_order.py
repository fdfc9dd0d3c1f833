"""GPTQ act-order kept quantized: a weight whose groups are not runs of consecutive inputs (each
input row's group in g_idx, in the order the quantizer visited them) is stored with its input rows
sorted by group, so the groups are runs again, and with `perm`: the original input of each stored
row. The matmul then reads its inputs in that order, x[..., perm] @ w_sorted (what vLLM's GPTQ
kernels do with g_idx); dequantizing puts the rows back.

`perm` has the weight's rank, the input axes at full size and size 1 on the outputs (so it splits
over a mesh as the weight's inputs do); its entries index the inputs flattened.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def shaped(perm: jax.Array | np.ndarray, shape: tuple[int, ...], inputs: tuple[int, ...]) -> jax.Array | np.ndarray:
    """A flat permutation of the inputs -> the weight-rank array a QuantizedWeight holds."""
    return perm.reshape([n if i in inputs else 1 for i, n in enumerate(shape)])


def _leading(inputs: tuple[int, ...]) -> None:
    if inputs != tuple(range(len(inputs))):
        raise ValueError(f"act-order needs the input axes first, not {inputs}")


def permuted_inputs(spec: str, x: jax.Array, perm: jax.Array, inputs: tuple[int, ...]) -> jax.Array:
    """x of `spec` ("x,w->out") with its contracted features in the stored rows' order."""
    _leading(inputs)
    operands, out = spec.split("->")
    x_letters, w_letters = operands.split(",")
    contracted = w_letters[: len(inputs)]
    if not x_letters.endswith(contracted):
        raise ValueError(f"act-order needs x's contracted axes last, in the weight's order: {spec}")
    lead = x.shape[: x.ndim - len(inputs)]
    flat = x.reshape(*lead, -1)
    return jnp.take(flat, perm.reshape(-1), axis=-1).reshape(x.shape)


def unpermuted(w: jax.Array, perm: jax.Array, inputs: tuple[int, ...]) -> jax.Array:
    """The float weight with its sorted input rows put back in their original order."""
    _leading(inputs)
    k = math.prod(w.shape[: len(inputs)])
    rows = w.reshape(k, -1)
    return rows[jnp.argsort(perm.reshape(-1))].reshape(w.shape)
