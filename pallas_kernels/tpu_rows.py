"""One kv head's K and V rows out of a VMEM buffer of whole tokens, for the TPU kernels.

The kernels copy whole pages ([page, 2Hkv, D]: every kv head's K and V rows, interleaved) into
VMEM buffers [slots, N, 2Hkv, D]. Indexing their row axis (`buf[slot, :, 2h, :]`) has Mosaic
load one sublane per token and shuffle N of them into [N, D] tiles: the decode kernel with KV
steps of 2048 tokens and 2 kv heads held ~78,000 vector operations, ~8,000 read this way
(benchmarks/RESULTS.md). Viewed as [N * 2Hkv, D] rows instead, head
h's K rows are every 2Hkv-th row from row 2h, and a strided load reads a whole tile of them at
once. Packed dtypes (bfloat16: two rows to a 32-bit word, int8 / float8: four) are read as
32-bit words, every (2Hkv / packing)-th from the word holding row 2h; K and V are then shifted
out of each word. Mosaic's strided loads take buffers of at most 128 lanes: a head_dim of 256
keeps the row-by-row read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.typing import DTypeLike

from pallas_kernels.common import Ref

_LANES = 128
_SUBLANES = 8


def packing(dtype: DTypeLike) -> int:
    """Rows of `dtype` in one 32-bit word."""
    return 4 // jnp.dtype(dtype).itemsize


def strided(rows: int, head_dim: int, dtype: DTypeLike) -> bool:
    """Whether `head_kv` reads a buffer of `rows` (2Hkv) rows of `dtype` by strided loads: the
    rows fill whole words (one-byte caches need an even number of kv heads); Mosaic folds the
    buffer's [N, rows] axes into one only where `rows` fills its 8-row tiles or divides one
    (2, 4, 8, 16, 24, ...; 6, 10 or 12 rows, i.e. 3, 5 or 6 kv heads, are refused: "tiled
    dimensions remain unchanged"); and a row takes at most 128 lanes."""
    return rows % packing(dtype) == 0 and (rows % _SUBLANES == 0 or _SUBLANES % rows == 0) and head_dim <= _LANES


def interpreted(interpret: object) -> bool:
    """Whether a pallas_call given `interpret` runs in the TPU interpreter: by the argument, or
    under an enclosing `pltpu.force_tpu_interpret_mode`."""
    if interpret:
        return True
    from jax._src import config  # the interpreter's context manager has no public reader

    return getattr(config, "pallas_tpu_interpret_mode_context_manager", None) is not None and (
        config.pallas_tpu_interpret_mode_context_manager.value is not None
    )


def head_kv(
    buf: Ref, slot: int | jax.Array, h: int, dtype: DTypeLike, *, interpret: bool = False
) -> tuple[jax.Array, jax.Array]:
    """buf: a VMEM ref [slots, N, 2Hkv, D] -> (K, V) of kv head `h`, [N, D] each, as `dtype`.

    `interpret`: the TPU interpreter takes refs indexed only, not reshaped or bitcast; there
    the same rows are read out of the loaded buffer."""
    _, n, rows, head_dim = buf.shape
    if not strided(rows, head_dim, buf.dtype):
        return buf[slot, :, 2 * h, :].astype(dtype), buf[slot, :, 2 * h + 1, :].astype(dtype)
    per_word = packing(buf.dtype)
    if interpret:
        flat = buf[slot].reshape(n * rows, head_dim)
        flat = flat if per_word == 1 else pltpu.bitcast(flat, jnp.uint32)

        def every(start, stride):  # rows start, start + stride, ... (n of them)
            return flat[start::stride][:n]
    else:
        flat = buf.at[slot].reshape(n * rows, head_dim)
        flat = flat if per_word == 1 else flat.bitcast(jnp.uint32)

        def every(start, stride):
            return flat[pl.ds(start, n, stride=stride), :]

    if per_word == 1:
        return every(2 * h, rows).astype(dtype), every(2 * h + 1, rows).astype(dtype)
    words = every(2 * h // per_word, rows // per_word)  # u32 [N, D]
    if per_word == 2:  # bfloat16: row 2h in the low half of each word, 2h + 1 in the high half
        k = pltpu.bitcast(words << 16, jnp.float32)
        v = pltpu.bitcast(words & jnp.uint32(0xFFFF0000), jnp.float32)
        return k.astype(dtype), v.astype(dtype)
    shift = 8 * (2 * h % per_word)  # one-byte rows: row 2h's byte, then row 2h + 1's

    def row(s):
        return pltpu.bitcast((words >> s).astype(jnp.uint8), buf.dtype).astype(dtype)

    return row(shift), row(shift + 8)
