"""The fused weights' layout in a TPU's memory: the one their matmuls read.

XLA:TPU lays a parameter out by its shape. A fused weight [in, group..., out] (q|k|v
[E, K, G + 2, D], gate|up [E, 2, F]) gets its small group axes as the tiled second-minor
axis (gate|up in 2-row tiles), while its matmul reads each group as an [in, out] matrix in
8-row tiles. The compiled step then relays every fused weight to that layout before its matmul,
on every step (about 2.2 GB of copies a step per chip for Llama-3.1-8B at tensor=4), and a decode
window hoists the copies out of its loop and keeps them all live (its temporaries then no longer
fit a v5e's HBM beside the KV pool: benchmarks/RESULTS.md). Placed in the layout the matmuls
read (the input axis second-minor, the groups major: major-to-minor (1, ..., n - 2, 0, n - 1)),
the weights are read as they are. A mixture's stacked experts likewise take the layout its
grouped matmuls read (each expert's [in, out] matrices whole). Other platforms keep the default
(row-major) layout, which their matmuls read as one [in, out] matrix.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.experimental.layout import Format, Layout

from sharding.rules import ParamAxes, PyTree, leaf_name

TILED_PLATFORMS = ("tpu",)


def dot_layout(axes: tuple[str, ...] | None, ndim: int) -> tuple[int, ...] | None:
    """Major-to-minor order for a weight of these logical axes on a TPU, or None (the default):
    - [in, group..., out] with the input ("embed") axis first and at least one group axis
      (q|k|v, gate|up): the groups major, the input axis second-minor;
    - experts stacked, [experts, in, group..., out] (a mixture's gate|up and down): the experts
      major, then the groups, then each [in, out] matrix, which is how the grouped matmul reads
      them. XLA:TPU's own layouts for these shapes avoid lane padding (it put a [X, F, 576]
      down projection's F minor) at the price of a copy before every grouped matmul."""
    if axes is None or len(axes) != ndim or ndim < 3:
        return None
    if axes[0] == "embed":
        return (*range(1, ndim - 1), 0, ndim - 1)
    if axes[0] == "experts":
        return (0, *range(2, ndim - 1), 1, ndim - 1)
    return None


def _platform(sharding: jax.sharding.Sharding) -> str:
    device: jax.Device = next(iter(sharding.device_set))  # jax's stubs leave device_set's element unnamed
    return device.platform


def weight_format(
    name: str, shape: tuple[int, ...], sharding: jax.sharding.Sharding, param_axes: ParamAxes
) -> jax.sharding.Sharding | Format:
    """Where a parameter goes: `sharding`, with the matmul's layout pinned for a fused weight
    on a TPU."""
    order = dot_layout(param_axes.get(name), len(shape))
    if order is None or _platform(sharding) not in TILED_PLATFORMS:
        return sharding
    return Format(Layout(major_to_minor=order), sharding)


def pin_weight_layouts(params: PyTree, param_axes: ParamAxes) -> PyTree:
    """The parameters with each fused weight on a TPU moved (on the device, once) into the layout
    its matmul reads; elsewhere, and for every other parameter, the arrays as they are."""

    def pin(path: jax.tree_util.KeyPath, x: Any) -> Any:  # x: any leaf; arrays are moved
        if not isinstance(x, jax.Array):
            return x
        target = weight_format(leaf_name(path), x.shape, x.sharding, param_axes)
        return x if isinstance(target, jax.sharding.Sharding) else jax.device_put(x, target)

    return jax.tree_util.tree_map_with_path(pin, params)
