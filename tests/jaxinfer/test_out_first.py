"""Out-first linear weights (jaxinfer/quant/out_first.py, out_first_int4.py): the same contraction
as the [in..., out...] weight at every row count, the product-and-sum form only where it pays (CPU,
2-32 rows, float32; int4 up to two rows), and the runner's layout on one CPU device, convertible
back."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_harness import small_cpu_worker
from testpaths import FIXTURES

from jaxinfer.config import ModelConfig
from jaxinfer.loader import LoadedModel, load_model
from jaxinfer.models import linear_layout as L
from jaxinfer.models.registry import get_family
from jaxinfer.quant import QuantConfig, QuantizedWeight, dequantize, einsum, quantization_of, quantized_tensors
from jaxinfer.quant.out_first import OutFirstWeight, contract_rows
from jaxinfer.quant.out_first_int4 import REDUCE_ROWS, OutFirstInt4

SPECS = [
    ("te,ekjd->tkjd", (6, 2, 3, 4), (0,)),
    ("thd,hde->te", (3, 4, 5), (0, 1)),
    ("te,ecf->tcf", (6, 2, 7), (0,)),
    ("tf,fe->te", (6, 5), (0,)),
]


@pytest.mark.parametrize("rows", [1, 2, 8, 32, 40])
@pytest.mark.parametrize("spec,shape,inputs", SPECS, ids=[s for s, _, _ in SPECS])
def test_out_first_einsum_equals_the_stored_weight(spec, shape, inputs, rows):
    w = jax.random.normal(jax.random.key(1), shape)
    x_shape = (rows, *[shape[i] for i in inputs])
    x = jax.random.normal(jax.random.key(2), x_shape)
    o = OutFirstWeight.of(w, inputs)
    assert o.shape == w.shape and o.t.shape[-len(inputs) :] == tuple(shape[i] for i in inputs)
    np.testing.assert_array_equal(o.stored(), w)
    want = jnp.einsum(spec, x, w, precision="highest")
    np.testing.assert_allclose(jax.jit(lambda a, b: einsum(spec, a, b))(x, o), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "rows,dtype,reduces",
    [
        (1, jnp.float32, False),
        (8, jnp.float32, True),
        (32, jnp.float32, True),
        (33, jnp.float32, False),
        (8, jnp.bfloat16, False),
    ],
)
def test_the_product_and_sum_form_only_where_it_pays(rows, dtype, reduces):
    x, w = jnp.ones((rows, 16), dtype), jnp.ones((24, 16), dtype)
    text = jax.jit(contract_rows).lower(x, w).as_text()
    assert ("stablehlo.dot_general" not in text) == reduces
    assert ("stablehlo.reduce" in text) == reduces


CONFIG = ModelConfig(
    model_type="llama",
    family="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
)


def test_the_cpu_runner_holds_layer_linears_out_first_and_a_mesh_gets_them_back():
    family = get_family("llama")
    params = family.init_params(CONFIG, jax.random.key(0))
    model = LoadedModel(CONFIG, params, None, family, Path("random"))
    small_cpu_worker(model)
    layer = model.params.layers[0]
    for name in L.LAYER_LINEARS:
        assert isinstance(getattr(layer, name), OutFirstWeight), name
        np.testing.assert_array_equal(getattr(layer, name).stored(), getattr(params.layers[0], name))
    assert not isinstance(model.params.lm_head, OutFirstWeight)  # the LM head and norms stay as they were
    back = L.linear_layout(model.params, mesh="a mesh")
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)


def int4_weight(shape, inputs, group, zeros, offsets, seed=0) -> QuantizedWeight:
    """A random int4 QuantizedWeight in the engine's layout (packed along the last input, the
    even input in the low nibble; scales by group, of size 1 on other inputs, a group longer
    than the last input spanning rows of the one before)."""
    rng = np.random.default_rng(seed)
    n_in, axis = len(inputs), len(inputs) - 1
    q = np.moveaxis(rng.integers(0, 16, shape).astype(np.uint8), axis, 0)
    values = np.moveaxis(q[0::2] | (q[1::2] << 4), 0, axis).astype(np.uint8)
    grouped = list(shape)
    if not group:
        grouped[:n_in] = [1] * n_in
    elif group <= shape[axis]:
        grouped[axis] = shape[axis] // group
    else:
        grouped[axis], grouped[axis - 1] = 1, shape[axis - 1] * shape[axis] // group
    scales = rng.random(grouped, dtype=np.float32) * 0.1 + 0.01
    z = jnp.asarray(rng.integers(5, 10, grouped).astype(np.uint8)) if zeros else None
    o = jnp.asarray(rng.standard_normal(grouped).astype(np.float32) * 0.1) if offsets else None
    return QuantizedWeight(jnp.asarray(values), jnp.asarray(scales), z, "int4", inputs, group, o, np.float32)


INT4_SPECS = [
    ("te,ekjd->tkjd", (64, 3, 2, 16), (0,), 32),
    ("thd,hde->te", (4, 64, 48), (0, 1), 32),
    ("thd,hde->te", (4, 64, 48), (0, 1), 128),  # a group over two heads
    ("tf,fe->te", (96, 40), (0,), 0),  # per channel
    ("te,ecf->tcf", (64, 2, 24), (0,), 16),
]


@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("zeros,offsets", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("spec,shape,inputs,group", INT4_SPECS, ids=[f"{s}-g{g}" for s, _, _, g in INT4_SPECS])
def test_out_first_int4_equals_the_dequantized_weight_and_converts_back(
    spec, shape, inputs, group, zeros, offsets, rows
):
    """One fused reduction over the packed bytes up to REDUCE_ROWS rows, the dequantized dot
    past them: both the stored weight's product; the stored layout comes back bit for bit."""
    w = int4_weight(shape, inputs, group, zeros, offsets)
    assert OutFirstInt4.convertible(w)
    o = OutFirstInt4.of(w)
    assert o.shape == w.shape and o.t.dtype == jnp.uint8 and o.t.size == w.values.size
    back = L.linear_layout({"w": o}, mesh="a mesh")["w"]
    assert isinstance(back, QuantizedWeight) and back.layout() == w.layout()
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(w), strict=True):
        np.testing.assert_array_equal(a, b)
    x = jax.random.normal(jax.random.key(rows), (rows, *shape[: len(inputs)]))
    want = jnp.einsum(spec, x, dequantize(w, jnp.float32), precision="highest")
    got = jax.jit(lambda a, b: einsum(spec, a, b))(x, o)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * float(jnp.abs(want).max()))
    text = jax.jit(lambda a, b: einsum(spec, a, b)).lower(x, o).as_text()
    assert ("stablehlo.floor" in text) == (rows <= REDUCE_ROWS)  # the packed bytes read as they are


def test_int4_with_act_order_or_quantized_activations_stays_as_stored():
    w = int4_weight((64, 24), (0,), 32, False, False)
    assert not OutFirstInt4.convertible(w.with_perm(np.arange(64)[::-1].copy()))
    w8a = QuantizedWeight(w.values, w.scales, None, "int4", (0,), 32, None, np.float32, ("int8", "token"))
    assert not OutFirstInt4.convertible(w8a)


def test_the_cpu_runner_holds_int4_linears_out_first_and_info_still_names_them():
    int4 = QuantConfig("int4", 16)
    model = load_model(FIXTURES / "hf" / "llama3", "float32", with_tokenizer=False, quantization=int4)
    stored = model.params.layers[0]
    small_cpu_worker(model)
    layer = model.params.layers[0]
    for name in L.LAYER_LINEARS:
        assert isinstance(getattr(layer, name), OutFirstInt4), name
        assert getattr(stored, name).layout() == "int4 g16 +offsets"
    assert quantization_of(model.params) == "int4"
    assert quantized_tensors(model.params)["w_down"] == {"int4 g16 +offsets": model.config.num_layers}
