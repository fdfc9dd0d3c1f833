"""Fused weights on a TPU in the layout their matmuls read (sharding/weight_layout.py); the
compiled TPU step's absence of weight relayouts is checked in tests/test_tpu_aot.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.models.llama import model as llama
from jaxinfer.models.moe import model as moe
from sharding.weight_layout import dot_layout, pin_weight_layouts, weight_format


@pytest.mark.parametrize(
    "name,want",
    [
        ("w_qkv", (1, 2, 0, 3)),  # [E, K, G + 2, D]: each kv head group's [E, D] matrices
        ("w_gate_up", (1, 0, 2)),  # [E, 2, F]: gate and up, each an [E, F] matrix
        ("wq", (1, 0, 2)),  # [E, H, D], the unfused form
        ("wo", None),  # [H, D, E]: contracted on its leading axes
        ("w_down", None),
        ("lm_head", None),
        ("embed", None),
        ("b_qkv", None),
    ],
)
def test_fused_weights_take_their_groups_major(name, want):
    axes = llama.PARAM_AXES[name]
    assert dot_layout(axes, len(axes)) == want
    assert dot_layout(axes, len(axes) + 1) is None  # a leaf of another shape (e.g. quantized scales)
    assert dot_layout(None, 3) is None


@pytest.mark.parametrize(
    "name,want",
    [
        ("experts_gate_up", (0, 2, 1, 3)),  # [X, E, 2, F]: each expert's gate and up [E, F] matrices
        ("experts_down", (0, 1, 2)),  # [X, F, E]: each expert an [F, E] matrix, row-major
        ("router", None),
        ("w_qkv", (1, 2, 0, 3)),
    ],
)
def test_stacked_experts_are_placed_as_the_grouped_matmuls_read_them(name, want):
    """A mixture's experts on a TPU: each expert's matrices [in, out] whole, as the grouped
    matmuls read them; XLA:TPU's own layout relaid them on every step."""
    axes = moe.PARAM_AXES[name]
    assert dot_layout(axes, len(axes)) == want


def test_other_platforms_keep_the_default_layout():
    """On the CPU (and GPUs) a fused weight stays as placed: the same array, the same sharding."""
    w = jax.device_put(jnp.ones((8, 2, 4), jnp.float32))
    sharding = w.sharding
    assert weight_format("w_gate_up", w.shape, sharding, llama.PARAM_AXES) is sharding
    params = {"w_gate_up": w, "w_down": jax.device_put(np.ones((4, 8), np.float32))}
    pinned = pin_weight_layouts(params, llama.PARAM_AXES)
    assert pinned["w_gate_up"] is w and pinned["w_down"] is params["w_down"]
