"""SmolLM2-135M GGUF (Q4_1, Q8_0 embedding) with its blocks kept quantized, end to end: the same
weights, logits and greedy tokens as dequantizing at load, the engine's greedy tokens equal to
transformers', parameter bytes from the arrays, an orbax round trip, `jaxinfer info`, and the
"auto" policy."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_harness import SingleSequence
from testpaths import FIXTURES, smollm2_gguf_path

from checkpoints.orbax_io import METADATA_FILE
from jaxinfer import cli
from jaxinfer.convert import convert
from jaxinfer.llm import LLM
from jaxinfer.loader import load_model
from jaxinfer.quant import QuantConfig, dequantize, param_bytes, quantized_tensors, resolve
from jaxinfer.sampling import SamplingParams

GOLDEN = np.load(FIXTURES / "smollm2" / "golden.npz")
GGUF = QuantConfig("gguf")
V, E, H, K, D, F, LAYERS = 49152, 576, 9, 3, 64, 1536, 30
LINEAR = E * (H + 2 * K) * D + H * D * E + 3 * E * F  # weights per layer: q|k|v, o, gate|up, down


@pytest.fixture(scope="module")
def models():
    load = lambda q: load_model(smollm2_gguf_path(), "float32", with_tokenizer=False, quantization=q)  # noqa: E731
    return {"none": load(None), "gguf": load(GGUF)}


def test_layouts_and_param_bytes_from_the_arrays(models):
    native = models["gguf"]
    assert native.quantization == GGUF and models["none"].quantization is None
    q4_1 = {"int4 g32 +offsets": LAYERS}
    assert quantized_tensors(native.params) == {
        "embed": {"int8 g32": 1},
        "w_qkv": q4_1,
        "wo": q4_1,
        "w_gate_up": q4_1,
        "w_down": q4_1,
    }
    embed = V * E + V * E // 32 * 2  # Q8_0: an int8 per weight, a float16 scale per 32
    linear = LINEAR // 2 + LINEAR // 32 * (2 + 2)  # Q4_1: 4 bits, float16 scale and min per 32
    norms = (LAYERS * 2 * E + E) * 4
    assert param_bytes(native.params) == embed + LAYERS * linear + norms
    assert param_bytes(models["none"].params) == (V * E + LAYERS * LINEAR) * 4 + norms
    assert param_bytes(native.params) / param_bytes(models["none"].params) < 0.18


def test_dequantized_weights_equal_the_dequantized_at_load_ones(models):
    native, plain = models["gguf"].params, models["none"].params
    np.testing.assert_array_equal(np.asarray(dequantize(native.embed)), np.asarray(plain.embed))
    for i in (0, LAYERS - 1):
        for field in ("w_qkv", "wo", "w_gate_up", "w_down"):
            got = jax.jit(dequantize)(getattr(native.layers[i], field))
            np.testing.assert_array_equal(np.asarray(got), np.asarray(getattr(plain.layers[i], field)))


@pytest.mark.slow  # compiles the 30-layer model twice (~20 s on a 2-core CPU)
def test_logits_equal_dequantized_at_load(models):
    # Teacher-forced over a prompt: every position's logits (and so its greedy token) agree.
    prompt = [1, 504, 3458, 282, 4649, 314, 2114, 30, 198, 504, 7042, 282, 253, 5029, 30, 198]
    ref, got = (
        SingleSequence(m.family, m.config, m.params, max_len=32).feed(prompt) for m in (models["none"], models["gguf"])
    )
    assert np.abs(got - ref).max() < 1e-3
    assert np.array_equal(np.argmax(got, -1), np.argmax(ref, -1))


@pytest.mark.slow  # the engine's warm-up compiles the native model (~40-100 s on a 2-core CPU)
def test_engine_greedy_matches_transformers():
    # transformers dequantized the same GGUF (the dequantized-at-load engine gives these tokens
    # too, tests/jaxinfer/test_llm.py); the engine on the native blocks must give them as well.
    llm = LLM(
        dtype="float32",
        quantization="gguf",
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        token_buckets=(64,),
    )
    assert llm.engine.model.quantization == GGUF
    stop = int(GOLDEN["greedy_stops_at"])
    out = llm.generate(
        GOLDEN["input_ids"].tolist(), SamplingParams(temperature=0, max_tokens=stop + 1), use_tqdm=False
    )[0]
    assert out.outputs[0].token_ids == GOLDEN["greedy"][: stop + 1].tolist()
    assert out.outputs[0].text == "The capital of France is Paris."


def test_orbax_round_trip_keeps_the_blocks(models, tmp_path):
    convert(smollm2_gguf_path(), tmp_path / "ckpt", dtype="float32", progress=False, quantization=GGUF)
    meta = json.loads((tmp_path / "ckpt" / METADATA_FILE).read_text())
    assert meta["quantization"]["method"] == "gguf"
    got = load_model(tmp_path / "ckpt", "float32", with_tokenizer=False)
    want = models["gguf"].params
    assert got.quantization == GGUF and jax.tree.structure(got.params) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want)):
        assert a.dtype == b.dtype  # float16 scales stay float16 in a float32 model
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="cannot load it as quantization='int8'"):
        load_model(tmp_path / "ckpt", "float32", with_tokenizer=False, quantization=QuantConfig("int8"))


def test_auto_policy_and_bad_requests():
    auto = QuantConfig("auto")
    assert resolve(auto, "gguf", None, True, "cpu", "m") is None  # measured slower on the CPU
    assert resolve(auto, "gguf", None, True, "gpu", "m") == GGUF
    assert resolve(auto, "gguf", None, True, "tpu", "m") == GGUF
    assert resolve(auto, "gguf", None, False, "gpu", "m") is None  # a family without quantized layers
    assert resolve(auto, "hf", None, True, "gpu", "m") is None
    assert resolve(auto, "ours", GGUF, True, "cpu", "m") == GGUF  # a saved quantization is kept
    assert resolve(None, "gguf", None, True, "gpu", "m") is None
    with pytest.raises(ValueError, match="quantization='gguf' keeps a GGUF file's quantized blocks, but m"):
        resolve(GGUF, "hf", None, True, "cpu", "m")
    with pytest.raises(ValueError, match="quantize_embedding=True needs quantization int8 or int4, not 'gguf'"):
        QuantConfig.parse("gguf", embedding=True)
    with pytest.raises(ValueError, match="'q4'"):
        QuantConfig.parse("q4")


def test_cli_info_reports_native_blocks(capsys):
    assert cli.main(["info", "--quantization", "gguf", "--num-pages", "8", "--max-model-len", "256"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert model["quantization"] == "gguf" and model["quantized_storage"] == "mixed"
    assert model["quantized_tensors"]["embed"] == {"int8 g32": 1}
    assert model["quantized_tensors"]["w_down"] == {"int4 g32 +offsets": LAYERS}
    assert model["stored_param_bytes"] < 100e6 and model["parameters"] == V * E + LAYERS * LINEAR + LAYERS * 2 * E + E
    # the CPU step holds int4 a byte per weight (quant/out_first_grouped.py)
    assert model["param_bytes"] == model["stored_param_bytes"] + LAYERS * LINEAR // 2
    assert jnp.dtype(model["dtype"]) == jnp.float32
    # the tied embedding, once: its Q8_0 blocks kept (int8 + a 2-byte scale per 32, as Q8_0 has it)
    assert model["embedding"] == {"tied": True, "quantized": True, "bytes": V * E + V * E // 32 * 2}


def test_cli_quantize_embedding_needs_int8_or_int4(capsys):
    assert cli.main(["info", "--quantize-embedding"]) == 2
    assert "quantize_embedding=True needs quantization int8 or int4, not 'auto'" in capsys.readouterr().err
