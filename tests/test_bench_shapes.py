"""benchmarks/shapes.py: random weights of real shapes, built one layer at a time, optionally
quantized on the device, run by the engine (tiny stand-ins of the shapes, on the CPU)."""

import dataclasses
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import shapes  # noqa: E402

from jaxinfer.config.engine import EngineConfig  # noqa: E402
from jaxinfer.engine import Engine  # noqa: E402
from jaxinfer.quant.weights import QuantizedWeight, dequantize  # noqa: E402
from jaxinfer.sampling.params import SamplingParams  # noqa: E402

TINY = {
    "tiny-dense": dataclasses.replace(shapes.SHAPES["smollm2"], num_layers=2, vocab_size=512),
    "tiny-moe": dataclasses.replace(
        shapes.SHAPES["qwen3-30b-a3b"],
        num_layers=3,
        hidden_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        vocab_size=512,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        mlp_only_layers=(1,),
    ),
    "tiny-untied": dataclasses.replace(
        shapes.SHAPES["smollm2"], num_layers=2, vocab_size=512, tie_word_embeddings=False
    ),
    "tiny-gemma": dataclasses.replace(
        shapes.shape_config("gemma-3-1b", 7),
        hidden_size=64,
        intermediate_size=96,
        vocab_size=512,
        num_heads=2,
        head_dim=32,
        query_pre_attn_scalar=32.0,
        sliding_window=4,
    ),
}


@pytest.fixture(autouse=True)
def tiny_shapes(monkeypatch):
    monkeypatch.setattr(shapes, "SHAPES", {**shapes.SHAPES, **TINY})


def _greedy(model, prompt=(1, 2, 3, 4), n=4):
    engine = Engine(
        model,
        EngineConfig(
            max_num_seqs=1, max_num_batched_tokens=8, max_model_len=32, num_decode_steps=1, async_scheduling=False
        ),
    )
    rid = engine.add_request(list(prompt), SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    tokens = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() if out.request_id == rid for t in out.outputs[0].token_ids]
    return tokens


@pytest.mark.parametrize("method,bound", [("int8", 0.01), ("int4", 0.1)])
def test_quantized_weights_stand_for_the_float_ones(method, bound):
    plain = shapes.random_model("tiny-dense", "float32")
    quant = shapes.random_model("tiny-dense", "float32", quantization=method)
    for field in ("w_qkv", "wo", "w_gate_up", "w_down"):
        w, q = getattr(plain.params.layers[0], field), getattr(quant.params.layers[0], field)
        assert isinstance(q, QuantizedWeight) and q.method == method and q.shape == w.shape
        err = float(jnp.max(jnp.abs(dequantize(q, jnp.float32) - w)) / jnp.max(jnp.abs(w)))
        assert err < bound, (field, err)
    ratio = shapes.param_bytes(quant) / shapes.param_bytes(plain)
    assert ratio < 0.5, ratio  # the embedding stays float; every layer weight shrinks
    if method == "int8":  # the engine runs it (int4's einsum path is the same call)
        assert len(_greedy(quant)) == 4


def test_moe_shape_builds_dense_and_sparse_layers_and_decodes():
    model = shapes.random_model("tiny-moe", "float32")
    assert [layer.router is None for layer in model.params.layers] == [False, True, False]
    assert len(_greedy(model)) == 4
    # FLOPs count only the experts a token runs: 2 of 8 here.
    active = shapes.prefill_floor_s(model, 1, 2.0)
    assert active < shapes.param_count(model.params)


def test_floors_count_one_vocabulary_table():
    """An untied embedding is looked up a row per token: the floors count only the LM head, as
    for the tied model, whose one table is both."""
    tied, untied = shapes.random_model("tiny-dense", "float32"), shapes.random_model("tiny-untied", "float32")
    assert untied.params.lm_head is not None and tied.params.lm_head is None
    assert shapes.param_bytes(untied) > shapes.param_bytes(tied)
    assert shapes.decode_floor_s(untied, 4, 64, 1e9) == shapes.decode_floor_s(tied, 4, 64, 1e9)
    assert shapes.prefill_floor_s(untied, 128, 1e9) == shapes.prefill_floor_s(tied, 128, 1e9)


def test_gemma_shape_keeps_its_layer_pattern_and_decodes():
    """The Gemma 3 shape cut to its first layers keeps their types (five sliding, then global)."""
    model = shapes.random_model("tiny-gemma", "float32", num_layers=6)
    assert model.config.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert [model.config.layer_window(i) for i in range(6)] == [4] * 5 + [None]
    assert len(model.params.layers) == 6 and len(_greedy(model, prompt=range(1, 10))) == 4
    with pytest.raises(ValueError, match="tiny-gemma"):
        shapes.hf_config("tiny-gemma")


def test_unknown_shape_and_quantization_are_named():
    with pytest.raises(ValueError, match="nope"):
        shapes.random_model("nope")
    with pytest.raises(ValueError, match="int3"):
        shapes.random_model("tiny-dense", "float32", quantization="int3")


def test_layers_differ():  # one compiled init, a fresh key per layer
    model = shapes.random_model("tiny-dense", "float32")
    a, b = (np.asarray(layer.w_qkv) for layer in model.params.layers)
    assert not np.allclose(a, b)


def test_llamacpp_peer_gguf_holds_the_hf_weights(tmp_path):
    """benchmarks/llamacpp_peer.py's float32 GGUF (q / k rows permuted as llama.cpp's converter
    does) loads back through our GGUF reader as exactly the HF directory's parameters."""
    import bench_load
    import jax
    import llamacpp_peer

    from jaxinfer.loader import load_model

    config = dataclasses.replace(shapes.SHAPES["smollm2"], num_layers=2, vocab_size=512, num_kv_heads=3)
    bench_load._write_safetensors(config, tmp_path / "hf")
    llamacpp_peer.write_gguf(tmp_path / "hf", tmp_path / "model.gguf")
    hf = load_model(tmp_path / "hf", "float32", with_tokenizer=False)
    gguf = load_model(tmp_path / "model.gguf", "float32", with_tokenizer=False)
    assert gguf.config.num_kv_heads == 3 and gguf.config.vocab_size == 512
    ours, theirs = (jax.tree_util.tree_flatten_with_path(m.params)[0] for m in (hf, gguf))
    assert [p for p, _ in ours] == [p for p, _ in theirs]
    for (path, a), (_, b) in zip(ours, theirs):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
