"""int4 packing, two values per byte along one axis, the even index in the low nibble: the one
definition the host quantizers (numpy) and the device layouts (jax arrays) share."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _xp(a: Any) -> Any:
    return jnp if isinstance(a, jax.Array) else np


def pack_int4(q: Any, axis: int) -> Any:
    """uint8 [.., n, ..] in 0..15 -> uint8 [.., n/2, ..] (numpy in, numpy out; jax in, jax out)."""
    xp = _xp(q)
    q = xp.moveaxis(xp.asarray(q).astype(xp.uint8), axis, 0)
    packed = xp.moveaxis(q[0::2] | (q[1::2] << 4), 0, axis)
    return np.ascontiguousarray(packed) if xp is np else packed


def unpack_int4(values: Any, axis: int) -> Any:
    """uint8 [.., n/2, ..] -> uint8 [.., n, ..] (low nibble first)."""
    xp = _xp(values)
    pairs = xp.stack([values & 0xF, values >> 4], axis=axis + 1)  # [.., n/2, 2, ..]
    shape = list(values.shape)
    shape[axis] *= 2
    return pairs.reshape(shape)
