"""GPTQ and AWQ checkpoints (packed by GPTQModel: tools/make_gptq_awq_reference.py) served as stored,
against the library's own unpacking and HF transformers' outputs on the unpacked weights."""

import hashlib
import json

import numpy as np
import pytest
from model_harness import SingleSequence
from quant_fixtures import edited_copy
from testpaths import FIXTURES

from checkpoints import CheckpointError, SafetensorsCheckpoint
from jaxinfer.loader import load_model
from jaxinfer.quant import QuantConfig, QuantizedWeight, gptq_awq, quantized_tensors
from jaxinfer.quant.compressed import dequantized, stored_quantization

QUANT = FIXTURES / "quant"
FIELDS = ("w_qkv", "wo", "w_gate_up", "w_down")
LAYOUTS = {  # fixture -> (method, layout of every quantized field)
    "gptq_g32": ("gptq", "int4 g32 +zeros"),
    "gptq_g32_asym": ("gptq", "int4 g32 +zeros"),
    "gptq_v2_g32_asym": ("gptq", "int4 g32 +zeros"),
    "gptq_8bit_channel": ("gptq", "int8 per-channel"),
    "gptq_actorder": ("gptq", "int4 g32 +zeros +act-order"),
    "awq_g32": ("awq", "int4 g32 +zeros"),
}


def _golden(name):
    return np.load(QUANT / name / "golden.npz")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_unpacking_is_the_librarys_bit_for_bit(name):
    """Every module's integers, zero points (v1's stored minus one, borrows across the word
    included) and scales give the float32 weights GPTQModel's own unpacking gives."""
    golden, reader = _golden(name), SafetensorsCheckpoint(QUANT / name)
    stored = stored_quantization(QUANT / name, name)
    modules = [k.removeprefix("sha256:") for k in golden.files if k.startswith("sha256:")]
    assert len(modules) == 14 and stored.scheme_for("lm_head") is None
    for module in modules:
        scheme = stored.scheme_for(module)
        out = reader.shape(f"{module}.scales")[1]
        inputs = reader.shape(f"{module}.qweight")[0] * (1 if name.startswith("awq") else 32 // scheme.bits)
        blocks, g_idx = gptq_awq.decode(reader, module, scheme, (out, inputs))
        assert (g_idx is not None) == (name == "gptq_actorder")
        w = dequantized(blocks, g_idx)
        assert hashlib.sha256(w.tobytes()).hexdigest() == str(golden[f"sha256:{module}"]), module


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_served_as_stored_matches_transformers(name):
    method, layout = LAYOUTS[name]
    golden = _golden(name)
    model = load_model(QUANT / name, dtype="float32", with_tokenizer=False, quantization=QuantConfig("auto"))
    assert model.quantization.method == method
    assert quantized_tensors(model.params) == {f: {layout: 2} for f in FIELDS}
    assert all(isinstance(getattr(layer, f), QuantizedWeight) for layer in model.params.layers for f in FIELDS)
    seq = SingleSequence(model.family, model.config, model.params, max_len=110)
    logits, greedy = seq.greedy(golden["prompt"], len(golden["greedy"]))
    assert np.abs(logits - golden["logits"]).max() < 1e-4
    assert greedy == golden["greedy"].tolist()


BAD = [
    ("gptq_g32", lambda c: c.update(bits=3), r"quantization_config.bits=3 is not served; one of \[4, 8\]"),
    ("gptq_g32", lambda c: c.update(checkpoint_format="marlin"), r"checkpoint_format='marlin' is not served"),
    ("gptq_g32", lambda c: c.update(lm_head=True), r"lm_head=true: a quantized LM head is not served"),
    ("gptq_g32", lambda c: c.update(group_size=24), r"group_size=24 does not divide its 64 inputs"),
    ("awq_g32", lambda c: c.update(version="gemv"), r"version='gemv' is not served"),
    ("awq_g32", lambda c: c.update(bits=8), r"quantization_config.bits=8 is not served; one of \[4\]"),
    ("awq_g32", lambda c: c.update(zero_point=False), r"zero_point=false"),
]


@pytest.mark.parametrize("name,edit,match", BAD)
def test_what_is_not_served_is_refused_by_name(tmp_path, name, edit, match):
    with pytest.raises(ValueError, match=match):
        load_model(edited_copy(tmp_path, name, edit_config=edit), dtype="float32", with_tokenizer=False)


def test_tensors_that_disagree_with_the_config_are_named(tmp_path):
    module = "model.layers.0.mlp.up_proj"

    def shrink(tensors):
        tensors[f"{module}.qweight"] = tensors[f"{module}.qweight"][:-1].copy()

    with pytest.raises(CheckpointError, match=rf"{module}.qweight: expected \(8, 128\), found \(7, 128\)"):
        load_model(edited_copy(tmp_path, "gptq_g32", edit_tensors=shrink), dtype="float32", with_tokenizer=False)

    def bad_groups(tensors):
        tensors[f"{module}.g_idx"] = tensors[f"{module}.g_idx"] + 5

    with pytest.raises(ValueError, match=rf"{module}.g_idx names groups outside 0..1"):
        load_model(edited_copy(tmp_path, "gptq_g32", edit_tensors=bad_groups), dtype="float32", with_tokenizer=False)
    awq = edited_copy(tmp_path, "awq_g32", edit_tensors=lambda t: t.pop(f"{module}.qzeros"))
    with pytest.raises(CheckpointError, match=rf"missing tensors \(1\): {module}.qzeros"):
        load_model(awq, dtype="float32", with_tokenizer=False)


def test_act_order_fuses_one_input_order_and_falls_back_to_float_for_two():
    """q|k|v (gate|up) read one input: act-order weights with one order fuse quantized, keeping
    it; orders that differ fuse as float, each member's rows put back first."""
    import jax.numpy as jnp

    from jaxinfer.quant import dequantize, fuse
    from jaxinfer.quant.quantize import quantize_int4

    rng = np.random.default_rng(0)
    a, b = (quantize_int4(rng.standard_normal((64, 16)).astype(np.float32), (0,), 32, np.float32) for _ in range(2))
    p1, p2 = rng.permutation(64).astype(np.int32), rng.permutation(64).astype(np.int32)
    pair = lambda x, y: jnp.stack([x, y], axis=1)  # noqa: E731
    same = fuse(pair, a.with_perm(p1), b.with_perm(p1))
    assert isinstance(same, QuantizedWeight) and same.perm.shape == (64, 1, 1)
    want = pair(dequantize(a.with_perm(p1)), dequantize(b.with_perm(p1)))
    np.testing.assert_array_equal(np.asarray(dequantize(same)), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(dequantize(a.with_perm(p1)))[p1], np.asarray(dequantize(a)))
    mixed = fuse(pair, a.with_perm(p1), b.with_perm(p2))
    assert not isinstance(mixed, QuantizedWeight)
    np.testing.assert_array_equal(
        np.asarray(mixed), np.asarray(pair(dequantize(a.with_perm(p1)), dequantize(b.with_perm(p2))))
    )


def test_act_order_survives_convert(tmp_path):
    """`jaxinfer convert` saves the act-order weights with their input order (NAME.perm); the
    orbax load computes the same logits."""
    from jaxinfer import cli

    dst = tmp_path / "orbax"
    assert cli.main(["convert", str(QUANT / "gptq_actorder"), str(dst), "--dtype", "float32", "-q"]) == 0
    stored = load_model(
        QUANT / "gptq_actorder", dtype="float32", with_tokenizer=False, quantization=QuantConfig("auto")
    )
    restored = load_model(dst, dtype="float32", with_tokenizer=False, quantization=QuantConfig("auto"))
    assert restored.quantization.method == "gptq"
    assert quantized_tensors(restored.params) == quantized_tensors(stored.params)
    prompt = _golden("gptq_actorder")["prompt"]
    runs = [SingleSequence(m.family, m.config, m.params, max_len=80).greedy(prompt, 4) for m in (stored, restored)]
    np.testing.assert_array_equal(runs[0][0], runs[1][0])


def test_autogptqs_quantize_config_json_is_read(tmp_path):
    """AutoGPTQ's older checkpoints carry their settings in quantize_config.json, not config.json."""
    target = edited_copy(tmp_path, "gptq_g32_asym")
    config = json.loads((target / "config.json").read_text())
    quant = config.pop("quantization_config")
    quant.pop("quant_method")
    (target / "config.json").write_text(json.dumps(config))
    (target / "quantize_config.json").write_text(json.dumps(quant))
    model = load_model(target, dtype="float32", with_tokenizer=False, quantization=QuantConfig("auto"))
    assert model.quantization.method == "gptq" and quantized_tensors(model.params)["wo"] == {"int4 g32 +zeros": 2}
    (target / "quantize_config.json").write_text(json.dumps({**quant, "bits": 2}))
    with pytest.raises(ValueError, match=r"quantize_config.json: quantization_config.bits=2 is not served"):
        load_model(target, dtype="float32", with_tokenizer=False)
