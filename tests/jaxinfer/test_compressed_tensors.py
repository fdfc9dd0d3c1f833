"""compressed-tensors checkpoints (made by llm-compressor: tools/make_quant_reference.py) served as
stored, against compressed-tensors' own decompression and HF transformers' outputs."""

import hashlib
import json
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from model_harness import SingleSequence
from quant_fixtures import edited_copy
from testpaths import FIXTURES, TESTS

from checkpoints import CheckpointError, SafetensorsCheckpoint
from jaxinfer.loader import load_model
from jaxinfer.quant import QuantConfig, QuantizedWeight, dequantize, quantized_tensors
from jaxinfer.quant.compressed import decode, dequantized, stored_quantization

sys.path.insert(0, str(TESTS.parent / "benchmarks"))
import ct_checkpoint  # noqa: E402

QUANT = FIXTURES / "quant"
# fixture -> (layout of every quantized field, the activations its weights' inputs get)
LAYOUTS = {
    "w4a16_g32": "int4 g32 +zeros",
    "w4a16_asym_g32": "int4 g32 +zeros",
    "w4a16_channel": "int4 per-channel +zeros",
    "w8a16": "int8 per-channel",
    "w8a8": "int8 per-channel +int8 activations per token",
    "fp8_dynamic": "fp8 per-channel +fp8 activations per token",
}
FIELDS = {"w_qkv", "wo", "w_gate_up", "w_down"}
# HF's logits are matched to float rounding, except W8A8's: every token's largest input divides
# to a tie at -127.5 or +127.5 (s = max|x| / 127.5), which torch's division rounds either way by an
# ulp and XLA:CPU's (not IEEE-exact) as well; the tokens still agree.
LOGITS_TOLERANCE = {"w8a8": 0.1}


def _golden(name):
    return np.load(QUANT / name / "golden.npz")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_decoding_is_the_librarys_bit_for_bit(name):
    """Every quantized module decoded and dequantized as compressed-tensors' own decompression
    (the sha256 of the float32 weights transformers loaded back)."""
    golden = _golden(name)
    reader = SafetensorsCheckpoint(QUANT / name)
    stored = stored_quantization(QUANT / name, name)
    modules = [k.removeprefix("sha256:") for k in golden.files if k.startswith("sha256:")]
    assert len(modules) == 14  # 7 projections x 2 layers; lm_head ignored
    for module in modules:
        scheme = stored.scheme_for(module)
        assert scheme is not None
        shape = reader.shape(f"{module}.weight_scale")[0], None
        blocks = decode(reader, module, scheme, (shape[0], _in_features(reader, module)), name)
        w = dequantized(blocks).astype(np.float32)
        assert hashlib.sha256(w.tobytes()).hexdigest() == str(golden[f"sha256:{module}"]), module
    assert stored.scheme_for("lm_head") is None


def _in_features(reader, module):
    if f"{module}.weight_shape" in reader.keys():
        return int(np.asarray(reader.get(f"{module}.weight_shape"))[1])
    return reader.shape(f"{module}.weight")[1]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_served_as_stored_matches_transformers(name):
    """Kept quantized in our layouts (o_proj's groups spanning two 16-wide heads included), equal to
    the dequantized load weight for weight, and HF's logits and greedy tokens."""
    golden = _golden(name)
    model = load_model(QUANT / name, dtype="float32", with_tokenizer=False, quantization=QuantConfig("auto"))
    assert model.quantization.method == "compressed-tensors"
    assert quantized_tensors(model.params) == {f: {LAYOUTS[name]: 2} for f in FIELDS}
    plain = load_model(QUANT / name, dtype="float32", with_tokenizer=False)  # quantization none: dequantized
    for layer, flat in zip(model.params.layers, plain.params.layers, strict=True):
        for field in FIELDS:
            w = getattr(layer, field)
            assert isinstance(w, QuantizedWeight) and not isinstance(getattr(flat, field), QuantizedWeight)
            np.testing.assert_array_equal(np.asarray(dequantize(w)), np.asarray(getattr(flat, field)))
    prompt = golden["prompt"]
    seq = SingleSequence(model.family, model.config, model.params, max_len=len(prompt) + 40)
    logits, greedy = seq.greedy(prompt, len(golden["greedy"]))
    assert np.abs(logits - golden["logits"]).max() < LOGITS_TOLERANCE.get(name, 2e-3)
    assert greedy == golden["greedy"].tolist()


def test_activations_are_quantized_per_token_as_calibrated():
    """int8 / fp8 per token as compressed-tensors computes it (exact arithmetic: the ties at the
    largest input aside, every value equals numpy's), and per tensor over everything."""
    from jaxinfer.quant.activations import fake_quantized

    x = np.random.default_rng(0).standard_normal((6, 4, 16)).astype(np.float32) * np.float32(3)
    amax = np.abs(x).max(axis=(1, 2), keepdims=True)
    for kind, r, lo, hi in (("int8", 127.5, -128, 127), ("fp8", 448.0, -448, 448)):
        s = amax / np.float32(r)
        q = np.clip(x / s, lo, hi)
        q = np.round(q) if kind == "int8" else q.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        want = q * s
        got = np.asarray(fake_quantized("thd,hde->te", x, (kind, "token")))
        near_tie = np.abs(np.abs(x / s) - np.floor(np.abs(x / s)) - 0.5) < 1e-4
        assert np.allclose(got, want, rtol=1e-6, atol=0) or np.allclose(got[~near_tie], want[~near_tie], rtol=1e-6)
        assert np.abs(got - x).max() > 1e-3  # it did quantize
    whole = np.asarray(fake_quantized("thd,hde->te", x, ("int8", "tensor")))
    assert len(np.unique(np.round(whole / (np.abs(x).max() / 127.5)))) > 100


@pytest.mark.parametrize("name,kind", [("w8a8", "int8"), ("fp8_dynamic", "fp8")])
def test_quantized_matmul_equals_the_float_form(monkeypatch, name, kind):
    """W8A8 where the backend multiplies int8 (TPU), FP8_DYNAMIC where it multiplies float8
    (NVIDIA): the products summed on the stored operands (int32 / float32), scaled after; the
    same logits as the float form within float rounding, the same tokens."""
    from jaxinfer.quant import activations

    golden = _golden(name)
    model = load_model(QUANT / name, dtype="float32", with_tokenizer=False, quantization=QuantConfig("auto"))
    runs = []
    for backends in ((), (jax.default_backend(),)):
        monkeypatch.setitem(activations.MATMUL_BACKENDS, kind, backends)
        assert activations.uses_quantized_matmul(model.params.layers[0].wo) == bool(backends)
        seq = SingleSequence(model.family, model.config, model.params, max_len=100)
        runs.append(seq.greedy(golden["prompt"], 8))
    (float_logits, float_greedy), (stored_logits, stored_greedy) = runs
    assert np.abs(stored_logits - float_logits).max() < 1e-4
    assert stored_greedy == float_greedy == golden["greedy"][:8].tolist()


def _group(config):
    return config["config_groups"]["group_0"]


BAD_CONFIGS = [
    (lambda c: c.update(quant_method="gptq-ish"), r"quant_method='gptq-ish' is not served"),
    (lambda c: _group(c)["weights"].update(num_bits=3), r"type='int' num_bits=3 is not served"),
    (lambda c: _group(c)["weights"].update(strategy="block"), r"weights.strategy='block' is not served"),
    (lambda c: _group(c)["weights"].update(actorder="group"), r"actorder='group': act-order"),
    (lambda c: _group(c)["weights"].update(group_size=24), r"group_size=24 does not divide its 64 inputs"),
    (lambda c: c.update(kv_cache_scheme={"num_bits": 8}), r"kv_cache_scheme: a quantized KV cache"),
    (lambda c: c.update(sparsity_config={"format": "sparse-24"}), r"sparse checkpoints are not served"),
    (lambda c: _group(c).update(targets=["LlamaAttention"]), r"'LlamaAttention' is not a linear layer"),
    (lambda c: _group(c).update(format="marlin-24"), r"format 'marlin-24' is not served"),
]


@pytest.mark.parametrize("edit,match", BAD_CONFIGS)
def test_what_is_not_served_is_refused_by_name(tmp_path, edit, match):
    with pytest.raises(ValueError, match=match):
        load_model(edited_copy(tmp_path, "w4a16_g32", edit_config=edit), dtype="float32", with_tokenizer=False)


def test_static_activation_scales_and_requantizing_are_refused(tmp_path):
    static = edited_copy(tmp_path, "w8a8", edit_config=lambda c: _group(c)["input_activations"].update(dynamic=False))
    with pytest.raises(ValueError, match="input_activations.dynamic=false: static activation scales"):
        load_model(static, dtype="float32", with_tokenizer=False)
    with pytest.raises(
        ValueError, match=r"stored quantized \(compressed-tensors: W4A16 g32\).*not requantized as 'int8'"
    ):
        load_model(QUANT / "w4a16_g32", dtype="float32", with_tokenizer=False, quantization=QuantConfig("int8"))
    with pytest.raises(ValueError, match="is not a compressed-tensors checkpoint"):
        load_model(FIXTURES / "hf" / "llama3", with_tokenizer=False, quantization=QuantConfig("compressed-tensors"))


def test_packed_shapes_that_disagree_with_the_config_are_named(tmp_path):
    module = "model.layers.1.mlp.down_proj"

    def shrink(tensors):
        tensors[f"{module}.weight_packed"] = tensors[f"{module}.weight_packed"][:, :-1].copy()

    with pytest.raises(CheckpointError, match=rf"{module}.weight_packed: expected \(64, 16\), found \(64, 15\)"):
        load_model(edited_copy(tmp_path, "w4a16_g32", edit_tensors=shrink), dtype="float32", with_tokenizer=False)

    def drop(tensors):
        del tensors[f"{module}.weight_scale"]

    with pytest.raises(CheckpointError, match=rf"missing tensors \(1\): {module}.weight_scale"):
        load_model(edited_copy(tmp_path, "w8a8", edit_tensors=drop), dtype="float32", with_tokenizer=False)


@pytest.mark.parametrize("scheme,name", [("W4A16-G32", "w4a16_g32"), ("W8A16", "w8a16"), ("W8A8", "w8a8"),
                                         ("FP8-DYNAMIC", "fp8_dynamic")])  # fmt: skip
def test_the_benchmarks_writer_is_llm_compressors_output(tmp_path, scheme, name):
    """benchmarks/ct_checkpoint.py (what the real-model tests and benchmarks write SmolLM2 with,
    torch-free) writes the tiny checkpoint byte for byte as llm-compressor did, every tensor."""
    tensors, config = ct_checkpoint.hf_tensors(str(FIXTURES / "hf" / "llama3"))
    mine = SafetensorsCheckpoint(ct_checkpoint.write(tensors, config, tmp_path, scheme))
    theirs = SafetensorsCheckpoint(QUANT / name)
    assert sorted(mine.keys()) == sorted(theirs.keys())
    for key in theirs.keys():
        a, b = np.asarray(mine.get(key)), np.asarray(theirs.get(key))
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), key
    ours, stored = (
        json.loads(p.read_text())["quantization_config"]
        for p in (tmp_path / "config.json", QUANT / name / "config.json")
    )
    assert stored_quantization(tmp_path, "mine") == stored_quantization(QUANT / name, "theirs")
    assert ours["format"] == stored["format"]


def test_convert_keeps_it_quantized_and_info_names_the_scheme(tmp_path, capsys):
    """`jaxinfer convert` (default --quantization auto) saves the W8A8 checkpoint to orbax as
    loaded; the orbax load restores the same layouts (activations included) and logits;
    `jaxinfer info` names the scheme and each field's layout."""
    from jaxinfer import cli

    dst = tmp_path / "orbax"
    assert cli.main(["convert", str(QUANT / "w8a8"), str(dst), "--dtype", "float32", "-q"]) == 0
    stored = load_model(QUANT / "w8a8", dtype="float32", with_tokenizer=False, quantization=QuantConfig("auto"))
    restored = load_model(dst, dtype="float32", with_tokenizer=False, quantization=QuantConfig("auto"))
    assert restored.quantization.activations == ("int8", "token")
    assert quantized_tensors(restored.params) == quantized_tensors(stored.params)
    prompt = _golden("w8a8")["prompt"]
    runs = [SingleSequence(m.family, m.config, m.params, max_len=80).greedy(prompt, 4) for m in (stored, restored)]
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    capsys.readouterr()
    assert cli.main(["info", "--model", str(QUANT / "w4a16_asym_g32"), "--dtype", "float32", "--num-pages", "8"]) == 0
    info = json.loads(capsys.readouterr().out)["model"]
    assert info["quantization"] == "compressed-tensors"
    assert info["quantization_scheme"] == "compressed-tensors: W4A16 g32 asymmetric"
    assert info["quantized_tensors"]["wo"] == {"int4 g32 +zeros": 2}
