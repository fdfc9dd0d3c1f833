"""Loading models: name/shape checks, bad inputs, and GGUF vs safetensors of the same weights."""

import dataclasses
import json
import shutil

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf_builder import llama_hf_to_gguf, write_gguf
from model_harness import SingleSequence
from safetensors.numpy import load_file, save_file
from testpaths import FIXTURES

from checkpoints import CheckpointError
from jaxinfer.config import ConfigError, ModelConfig
from jaxinfer.loader import load_model

LLAMA = FIXTURES / "hf" / "llama3"


def _copy_with(tmp_path, edit):
    """The llama3 fixture with its tensors edited by `edit(dict)`."""
    dst = tmp_path / "m"
    dst.mkdir()
    shutil.copy(LLAMA / "config.json", dst / "config.json")
    tensors = load_file(str(LLAMA / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _load(path, **kw):
    return load_model(path, dtype="float32", with_tokenizer=False, **kw)


def test_missing_tensor_is_named(tmp_path):
    path = _copy_with(tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors \(1\): model.layers.1.mlp.up_proj.weight"):
        _load(path)


def test_unexpected_tensor_is_named(tmp_path):
    path = _copy_with(tmp_path, lambda t: t.update({"model.layers.0.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(CheckpointError, match="unexpected tensors .*model.layers.0.extra.weight"):
        _load(path)


def test_misshaped_tensor_is_named(tmp_path):
    def edit(t):
        t["model.norm.weight"] = np.ones(65, np.float32)

    with pytest.raises(CheckpointError, match=r"model.norm.weight: expected \(64,\), found \(65,\)"):
        _load(_copy_with(tmp_path, edit))


def test_unknown_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        _load(tmp_path / "does-not-exist")


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        _load(tmp_path)


def test_config_missing_field(tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(LLAMA, dst)
    cfg = json.loads((dst / "config.json").read_text())
    del cfg["num_key_value_heads"], cfg["intermediate_size"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="intermediate_size"):
        _load(dst)


def test_bad_dtype():
    with pytest.raises(ValueError, match="'float64'"):
        load_model(LLAMA, dtype="float64", with_tokenizer=False)


def test_gguf_of_unsupported_architecture(tmp_path):
    path = write_gguf(
        tmp_path / "m.gguf", "mamba", {"mamba.block_count": 2}, {"token_embd.weight": np.zeros((4, 32), np.float32)}
    )
    with pytest.raises(ConfigError, match="unsupported general.architecture 'mamba'"):
        _load(path)


def _llama_as_gguf(tmp_path, qtypes=None):
    config = json.loads((LLAMA / "config.json").read_text())
    config["rope_parameters"] = {"rope_theta": 500000.0, "rope_type": "default"}
    meta, tensors = llama_hf_to_gguf(config, load_file(str(LLAMA / "model.safetensors")))
    return write_gguf(tmp_path / "llama.gguf", "llama", meta, tensors, qtypes), config


def test_gguf_matches_safetensors_of_same_weights(tmp_path):
    """GGUF name map and llama.cpp's q/k rotary permutation undone exactly."""
    gguf_path, config = _llama_as_gguf(tmp_path)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(config))  # same model without rope scaling
    shutil.copy(LLAMA / "model.safetensors", hf_dir)
    a, b = _load(gguf_path), _load(hf_dir)
    assert a.config.num_layers == b.config.num_layers and a.config.tie_word_embeddings is False
    prompt = np.load(LLAMA / "golden.npz")["input_ids"][:40]
    la = SingleSequence(a.family, a.config, a.params, 48).feed(prompt)
    lb = SingleSequence(b.family, b.config, b.params, 48).feed(prompt)
    np.testing.assert_allclose(la, lb, atol=1e-5)


def test_quantized_gguf_loads_close(tmp_path):
    names = {f"blk.{i}.{n}": Q.Q8_0 for i in range(2) for n in ("attn_q.weight", "ffn_up.weight")}
    gguf_path, _ = _llama_as_gguf(tmp_path, names)
    m = _load(gguf_path)
    layer = m.params.layers[0]  # 8 query heads in 2 groups of 4, each followed by its K and V
    assert layer.w_qkv.shape == (64, 2, 4 + 2, 16) and layer.w_gate_up.shape == (64, 2, 128)
    prompt = np.load(LLAMA / "golden.npz")["input_ids"][:16]
    assert np.isfinite(SingleSequence(m.family, m.config, m.params, 16).feed(prompt)).all()


def test_gguf_rope_freqs_reproduce_llama3_scaling(tmp_path):
    """llama.cpp stores llama3 rope scaling as per-frequency divisors (rope_freqs.weight); the
    GGUF of the llama3 fixture with those divisors must give HF's llama3-scaled logits."""
    from jaxinfer.models.layers import rope_inv_freq

    scaled = ModelConfig.from_hf_file(LLAMA / "config.json")
    factors = rope_inv_freq(dataclasses.replace(scaled, rope_scaling=None)) / rope_inv_freq(scaled)
    assert (factors > 1.01).any() and (np.abs(factors - 1) < 1e-6).any()  # scaled and unscaled bands
    config = json.loads((LLAMA / "config.json").read_text())
    meta, tensors = llama_hf_to_gguf(config, load_file(str(LLAMA / "model.safetensors")))
    tensors["rope_freqs.weight"] = factors.astype(np.float32)
    m = _load(write_gguf(tmp_path / "llama31.gguf", "llama", meta, tensors))
    assert m.config.rope_freq_factors is not None
    golden = np.load(LLAMA / "golden.npz")
    logits = SingleSequence(m.family, m.config, m.params, 64).feed(golden["input_ids"])
    assert np.abs(logits - golden["logits"]).max() < 1e-3


@pytest.mark.parametrize("name", ["qwen3", "qwen3_tied"])
def test_qwen3_gguf_reproduces_hf_golden(tmp_path, name):
    """llama.cpp's qwen3 architecture: no rotary permutation, QK-norm as attn_q_norm /
    attn_k_norm, tied when there is no output.weight; HF's logits (greedy: test_model_parity)."""
    src = FIXTURES / "hf" / name
    config = json.loads((src / "config.json").read_text())
    meta, tensors = llama_hf_to_gguf(config, load_file(str(src / "model.safetensors")), arch="qwen3")
    m = _load(write_gguf(tmp_path / f"{name}.gguf", "qwen3", meta, tensors))
    hf = ModelConfig.from_hf_file(src / "config.json")
    assert dataclasses.replace(m.config, rms_norm_eps=hf.rms_norm_eps) == hf  # GGUF's eps is float32
    assert m.config.qk_norm and m.config.tie_word_embeddings == config["tie_word_embeddings"]
    golden = np.load(src / "golden.npz")
    logits = SingleSequence(m.family, m.config, m.params, 64).feed(golden["input_ids"])
    assert np.abs(logits - golden["logits"]).max() < 1e-3
    np.testing.assert_array_equal(logits.argmax(-1), golden["logits"].argmax(-1))
