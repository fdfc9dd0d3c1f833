"""Out-first linear weights (jaxinfer/quant/out_first.py, out_first_grouped.py): the same contraction
as the [in..., out...] weight at every row count, the product-and-sum form only where it pays (CPU,
2-32 rows, float32; grouped int4 / int8 up to two rows), and the runner's layout on one CPU device, convertible
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
from jaxinfer.quant.out_first_grouped import REDUCE_ROWS, OutFirstGrouped

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


def grouped_weight(shape, inputs, group, zeros, offsets, seed=0, method="int4") -> QuantizedWeight:
    """A random int4 (or int8) QuantizedWeight in the engine's layout (int4 packed along the
    last input, the even input in the low nibble; scales by group, of size 1 on other inputs, a
    group longer than the last input spanning rows of the one before)."""
    rng = np.random.default_rng(seed)
    axis = inputs[-1]
    if method == "int8":
        values = rng.integers(-127, 128, shape).astype(np.int8)
    else:
        q = np.moveaxis(rng.integers(0, 16, shape).astype(np.uint8), axis, 0)
        values = np.moveaxis(q[0::2] | (q[1::2] << 4), 0, axis).astype(np.uint8)
    grouped = list(shape)
    if not group:
        for i in inputs:
            grouped[i] = 1
    elif group <= shape[axis]:
        grouped[axis] = shape[axis] // group
    else:
        grouped[axis], grouped[axis - 1] = 1, shape[axis - 1] * shape[axis] // group
    scales = rng.random(grouped, dtype=np.float32) * 0.1 + 0.01
    z = jnp.asarray(rng.integers(5, 10, grouped).astype(np.uint8)) if zeros else None
    o = jnp.asarray(rng.standard_normal(grouped).astype(np.float32) * 0.1) if offsets else None
    return QuantizedWeight(jnp.asarray(values), jnp.asarray(scales), z, method, inputs, group, o, np.float32)


INT4_SPECS = [
    ("te,ekjd->tkjd", (64, 3, 2, 16), (0,), 32),
    ("thd,hde->te", (4, 64, 48), (0, 1), 32),
    ("thd,hde->te", (4, 64, 48), (0, 1), 128),  # a group over two heads
    ("tf,fe->te", (96, 40), (0,), 0),  # per channel
    ("te,ecf->tcf", (64, 2, 24), (0,), 16),
]


# Per-channel int8 is OutFirstInt8's (out_first_int8.py), so int8 takes the grouped cases only.
GROUPED = [("int4", *case) for case in INT4_SPECS] + [("int8", *case) for case in INT4_SPECS if case[3]]


@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("zeros,offsets", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("method,spec,shape,inputs,group", GROUPED, ids=[f"{m}-{s}-g{g}" for m, s, _, _, g in GROUPED])
def test_out_first_grouped_equals_the_dequantized_weight_and_converts_back(
    method, spec, shape, inputs, group, zeros, offsets, rows
):
    """One fused reduction over the integers (a byte each) up to REDUCE_ROWS rows, the
    dequantized dot past them: both the stored weight's product; the stored layout comes back
    bit for bit."""
    w = grouped_weight(shape, inputs, group, zeros, offsets, method=method)
    assert OutFirstGrouped.convertible(w)
    o = OutFirstGrouped.of(w)
    stored_dtype = {"int4": jnp.uint8, "int8": jnp.int8}[method]
    assert o.shape == w.shape and o.t.dtype == stored_dtype and o.t.size == np.prod(shape)
    back = L.linear_layout({"w": o}, mesh="a mesh")["w"]
    assert isinstance(back, QuantizedWeight) and back.layout() == w.layout()
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(w), strict=True):
        np.testing.assert_array_equal(a, b)
    x = jax.random.normal(jax.random.key(rows), (rows, *shape[: len(inputs)]))
    want = jnp.einsum(spec, x, dequantize(w, jnp.float32), precision="highest")
    got = jax.jit(lambda a, b: einsum(spec, a, b))(x, o)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * float(jnp.abs(want).max()))
    text = jax.jit(lambda a, b: einsum(spec, a, b)).lower(x, o).as_text()
    dots = text.count("stablehlo.dot_general")  # the weight's (past REDUCE_ROWS), the shift's
    assert dots == (rows > REDUCE_ROWS) + (zeros or offsets)


def test_act_order_quantized_activations_expert_stacks_and_per_channel_int8_stay_as_stored():
    w = grouped_weight((64, 24), (0,), 32, False, False)
    assert not OutFirstGrouped.convertible(w.with_perm(np.arange(64)[::-1].copy()))
    w8a = QuantizedWeight(w.values, w.scales, None, "int4", (0,), 32, None, np.float32, ("int8", "token"))
    assert not OutFirstGrouped.convertible(w8a)
    experts = grouped_weight((4, 64, 24), (1,), 32, False, False)  # [experts, in, out]: the einsum shares e
    assert not OutFirstGrouped.convertible(experts)
    assert not OutFirstGrouped.convertible(grouped_weight((64, 24), (0,), 0, False, False, method="int8"))


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("method", ["int4", "int8"])
def test_a_grouped_weight_with_trailing_inputs_reduces_where_it_is_stored(method, rows):
    """A tied LM head's quantized embedding [V, E] (inputs trailing, e.g. a GGUF's int8 blocks)
    is out-first as stored: on the CPU a few rows contract as the fused reduction over it (no
    dequantized copy, no dot), more as the dequantized dot; the out-first form is a reshape
    and converts back bit for bit."""
    w = grouped_weight((48, 64), (1,), 32, False, method == "int4", method=method)
    o = OutFirstGrouped.of(w)
    assert o.t.shape == (48, 2, 32) and o.scales.shape == (48, 2)
    for a, b in zip(o.stored_arrays(), (w.values, w.scales, w.zeros, w.offsets), strict=True):
        assert (a is None and b is None) or np.array_equal(a, b)
    x = jax.random.normal(jax.random.key(rows), (rows, 64))
    want = jnp.einsum("ne,ve->nv", x, dequantize(w, jnp.float32), precision="highest")
    got = jax.jit(lambda a, b: einsum("ne,ve->nv", a, b))(x, w)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * float(jnp.abs(want).max()))
    text = jax.jit(lambda a, b: einsum("ne,ve->nv", a, b)).lower(x, w).as_text()
    # past REDUCE_ROWS: the dequantized weight's dot; up to it, the offsets' small one (int4)
    assert text.count("stablehlo.dot_general") == (1 if rows > REDUCE_ROWS else int(method == "int4"))


@pytest.mark.parametrize("method,layout", [("int4", "int4 g16 +offsets"), ("int8", "int8 g16")])
def test_the_cpu_runner_holds_grouped_linears_out_first_and_info_still_names_them(method, layout):
    model = load_model(
        FIXTURES / "hf" / "llama3", "float32", with_tokenizer=False, quantization=QuantConfig(method, 16)
    )
    stored = model.params.layers[0]
    small_cpu_worker(model)
    layer = model.params.layers[0]
    for name in L.LAYER_LINEARS:
        assert isinstance(getattr(layer, name), OutFirstGrouped), name
        assert getattr(stored, name).layout() == layout
    assert quantization_of(model.params) == method
    assert quantized_tensors(model.params)["w_down"] == {layout: model.config.num_layers}
