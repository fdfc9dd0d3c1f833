"""Out-first float linear weights (jaxinfer/quant/out_first.py): the same contraction as the
[in..., out...] weight at every row count, the product-and-sum form only where it pays (CPU,
2-32 rows, float32), and the runner's layout on one CPU device, convertible back."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.loader import LoadedModel
from jaxinfer.models import linear_layout as L
from jaxinfer.models.registry import get_family
from jaxinfer.quant import einsum
from jaxinfer.quant.out_first import OutFirstWeight, contract_rows
from jaxinfer.worker.worker import Worker

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
    Worker(
        model,
        EngineConfig(
            max_num_batched_tokens=8,
            max_num_seqs=8,
            token_buckets=(1, 8),
            compilation_cache_dir=None,
            num_pages=16,
            max_model_len=64,
        ),
        64,
    )
    layer = model.params.layers[0]
    for name in L.LAYER_LINEARS:
        assert isinstance(getattr(layer, name), OutFirstWeight), name
        np.testing.assert_array_equal(getattr(layer, name).stored(), getattr(params.layers[0], name))
    assert not isinstance(model.params.lm_head, OutFirstWeight)  # the LM head and norms stay as they were
    back = L.linear_layout(model.params, mesh="a mesh")
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)
