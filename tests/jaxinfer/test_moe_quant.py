"""Weight-only quantization of mixtures of experts (Qwen3-MoE, Mixtral): each expert's gate, up
and down quantized as it is read, stacked with its scales, unstacked for the CPU's per-expert
layout; every form of the expert MLP equal to the same math on the dequantized weights; logits
and greedy tokens against the float model; GGUF expert blocks kept; an orbax round trip."""

import json

import gguf
import jax
import numpy as np
import pytest
from gguf_builder import moe_hf_to_gguf, write_gguf
from model_harness import SingleSequence
from safetensors.numpy import load_file
from testpaths import FIXTURES

from jaxinfer.convert import convert
from jaxinfer.llm import LLM
from jaxinfer.loader import load_model
from jaxinfer.models import experts
from jaxinfer.quant import (
    QuantConfig,
    QuantizedWeight,
    dequantize,
    param_bytes,
    quantize_field,
    quantized_tensors,
    unstack,
)
from jaxinfer.sampling import SamplingParams

PROMPT = [1, 17, 301, 45, 9, 250, 77, 3, 128, 64, 5, 499]
# Group 8 divides both fixtures' hidden sizes (48, 64), expert widths (24, 40) and head_dim 16.
METHODS = {"int8": QuantConfig("int8"), "int8-g8": QuantConfig("int8", 8), "int4-g8": QuantConfig("int4", 8)}


def _cosine(a, b) -> np.ndarray:
    return np.sum(a * b, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_form_equals_the_dequantized_weights(method):
    """The dense (every expert, one batched matmul), ragged (grouped matmuls; per-channel int8 on
    its integers with each row scaled by its expert's scales), capacity and per-expert forms, on quantized
    stacked experts, against the dense form on the weights they stand for."""
    keys = jax.random.split(jax.random.PRNGKey(1), 4)
    x = jax.random.normal(keys[0], (71, 48))
    router = jax.random.normal(keys[1], (48, 8))
    quant = METHODS[method]
    w_gate_up = quantize_field(
        0.1 * np.asarray(jax.random.normal(keys[2], (8, 48, 2, 24))), "experts_gate_up", (1,), quant, np.float32
    )
    w_down = quantize_field(
        0.1 * np.asarray(jax.random.normal(keys[3], (8, 24, 48))), "experts_down", (1,), quant, np.float32
    )
    mlp = lambda x, w1, w2, impl="dense": experts.moe_mlp(  # noqa: E731
        x, router, w1, w2, top_k=3, renormalize=True, impl=impl
    )
    want = np.asarray(jax.jit(mlp)(x, dequantize(w_gate_up), dequantize(w_down)))
    for impl in ("dense", "ragged", "capacity"):
        got = jax.jit(mlp, static_argnums=3)(x, w_gate_up, w_down, impl)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0, err_msg=impl)
    # one token, top 2 of 8: the capacity form gathers the chosen experts' quantized arrays
    top2 = lambda x, w1, w2, impl="dense": experts.moe_mlp(  # noqa: E731
        x, router, w1, w2, top_k=2, renormalize=True, impl=impl
    )
    np.testing.assert_allclose(
        jax.jit(top2, static_argnums=3)(x[:1], w_gate_up, w_down, "capacity"),
        top2(x[:1], dequantize(w_gate_up), dequantize(w_down)),
        atol=2e-5,
        rtol=0,
    )
    gate_up, down = unstack(w_gate_up), unstack(w_down)
    assert len(gate_up) == 8 and isinstance(gate_up[0], QuantizedWeight)
    assert gate_up[0].shape == (48, 2, 24) and gate_up[0].inputs == (0,) and down[0].inputs == (0,)
    for t in (1, 5, 71):  # a switch per choice under 64 tokens, a conditional per expert from 64
        got = jax.jit(mlp)(x[:t], gate_up, down)
        np.testing.assert_allclose(got, want[:t], atol=2e-5, rtol=0, err_msg=f"per expert, {t} tokens")


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def runs(request):
    """name -> {method: (model, teacher-forced logits, greedy tokens)} of a fixture model."""
    out = {}
    for method, quant in {"float": None, **METHODS}.items():
        model = load_model(FIXTURES / "hf" / request.param, "float32", with_tokenizer=False, quantization=quant)
        params = model.family.compute_layout(model.params, None)  # the CPU runner's per-expert layout
        logits, tokens = SingleSequence(model.family, model.config, params, max_len=64).greedy(PROMPT, 12)
        out[method] = (model, logits, tokens)
    return request.param, out


@pytest.mark.parametrize(
    "method,min_cos,same_tokens", [("int8", 0.999, 12), ("int8-g8", 0.999, 12), ("int4-g8", 0.95, 4)]
)
def test_logits_and_greedy_tokens_close_to_float(runs, method, min_cos, same_tokens):
    # Measured minimum cosines at every position: int8 0.9993 (Mixtral) / 0.9999 (Qwen3-MoE),
    # int8 g8 0.9997 / 0.9999, int4 g8 0.962 / 0.982; the random fixtures' near-flat logits let
    # int4 flip a greedy token after its first 4-5.
    name, out = runs
    model, logits, tokens = out[method]
    _, ref_logits, ref_tokens = out["float"]
    assert np.min(_cosine(logits, ref_logits)) > min_cos
    assert tokens[:same_tokens] == ref_tokens[:same_tokens]
    assert not np.array_equal(logits, ref_logits)
    layout = next(iter(quantized_tensors(model.params)["experts_gate_up"]))
    sparse = [layer for layer in model.params.layers if layer.router is not None]
    assert quantized_tensors(model.params)["experts_down"] == {layout: len(sparse)}
    c = model.config
    assert sparse[0].experts_gate_up.shape == (c.num_experts, c.hidden_size, 2, c.moe_intermediate_size)
    assert sparse[0].experts_gate_up.inputs == (1,) and sparse[0].experts_down.inputs == (1,)


def test_expert_bytes_from_the_arrays(runs):
    _, out = runs
    c = out["float"][0].config
    x, e, f = c.num_experts, c.hidden_size, c.moe_intermediate_size
    weights = x * 3 * e * f  # gate, up and down of every expert, per sparse layer
    experts_bytes = lambda m: [
        param_bytes((layer.experts_gate_up, layer.experts_down))  # noqa: E731
        for layer in m.params.layers
        if layer.router is not None
    ]
    sparse = len(experts_bytes(out["float"][0]))
    assert experts_bytes(out["float"][0]) == [4 * weights] * sparse
    # int8: a byte a weight and a float32 scale per output channel (2F for gate|up, E for down).
    assert experts_bytes(out["int8"][0]) == [weights + 4 * x * (2 * f + e)] * sparse
    # int4 g8: half a byte a weight and a float32 scale and offset per 8 inputs.
    assert experts_bytes(out["int4-g8"][0]) == [weights // 2 + 8 * weights // 8] * sparse


def test_orbax_round_trip_restores_the_quantized_experts(tmp_path):
    quant = QuantConfig("int4", 8)
    convert(FIXTURES / "hf" / "qwen3_moe", tmp_path / "ckpt", dtype="float32", progress=False, quantization=quant)
    got = load_model(tmp_path / "ckpt", "float32", with_tokenizer=False)
    want = load_model(FIXTURES / "hf" / "qwen3_moe", "float32", with_tokenizer=False, quantization=quant)
    assert got.quantization == quant
    assert jax.tree.structure(got.params) == jax.tree.structure(want.params)
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_gguf_expert_blocks_kept(tmp_path):
    """Mixtral's stacked experts as Q8_0 (gate) and Q4_0 (up) blocks, down kept float32 (its
    40-wide rows do not fill GGUF's 32-weight blocks): quantization="gguf" keeps the blocks (gate
    and up fused into one int8 layout) and computes what dequantizing at load computes."""
    cfg = json.loads((FIXTURES / "hf" / "mixtral" / "config.json").read_text())
    meta, tensors = moe_hf_to_gguf(cfg, load_file(FIXTURES / "hf" / "mixtral" / "model.safetensors"), "llama")
    kinds = {"ffn_gate_exps": gguf.GGMLQuantizationType.Q8_0, "ffn_up_exps": gguf.GGMLQuantizationType.Q4_0}
    qtypes = {name: kinds[kind] for name in tensors for kind in kinds if f".{kind}." in name}
    assert len(qtypes) == 2 * cfg["num_hidden_layers"]
    path = write_gguf(tmp_path / "mixtral.gguf", "llama", meta, tensors, qtypes)
    native = load_model(path, "float32", quantization=QuantConfig("gguf"))
    plain = load_model(path, "float32", quantization=None)
    layer, ref = native.params.layers[0], plain.params.layers[0]
    assert isinstance(layer.experts_gate_up, QuantizedWeight) and layer.experts_gate_up.group == 32
    assert not isinstance(layer.experts_down, QuantizedWeight)
    np.testing.assert_array_equal(np.asarray(dequantize(layer.experts_gate_up)), np.asarray(ref.experts_gate_up))
    runs = [
        SingleSequence(m.family, m.config, m.family.compute_layout(m.params, None), max_len=64).greedy(PROMPT, 8)
        for m in (native, plain)
    ]
    np.testing.assert_allclose(runs[0][0], runs[1][0], atol=2e-5, rtol=0)
    assert runs[0][1] == runs[1][1]


def test_llm_generates_with_quantized_experts():
    llm = LLM(
        str(FIXTURES / "hf" / "qwen3_moe"),
        "float32",
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        token_buckets=[8, 32],
        quantization="int8",
        compilation_cache_dir=None,
    )
    out = llm.generate(
        [PROMPT, PROMPT[:5]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
    )
    assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]
    layer = next(layer for layer in llm.engine.worker.state.params.layers if layer.router is not None)
    assert isinstance(layer.experts_gate_up, tuple) and isinstance(layer.experts_gate_up[0], QuantizedWeight)
