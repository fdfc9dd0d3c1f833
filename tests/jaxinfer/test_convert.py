"""`jaxinfer convert`: HF directories and GGUF files -> orbax checkpoints that load as the source does."""

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest
from model_harness import SingleSequence
from testpaths import FIXTURES, smollm2_gguf_path

from checkpoints import CheckpointError
from checkpoints.orbax_io import METADATA_FILE
from jaxinfer.cli import main
from jaxinfer.config import ModelConfig
from jaxinfer.convert import convert
from jaxinfer.llm import LLM
from jaxinfer.loader import load_model
from jaxinfer.sampling import SamplingParams

LLAMA = FIXTURES / "hf" / "llama3"
GENERATE = json.loads((LLAMA / "generate.json").read_text())


def _leaves_equal(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", ["llama3", "qwen2", "tied_gqa3", "qwen3", "qwen3_moe"])
def test_hf_directory_converts_to_equal_params(tmp_path, name):
    stats = convert(FIXTURES / "hf" / name, tmp_path / "ckpt", progress=False)
    meta = json.loads((tmp_path / "ckpt" / METADATA_FILE).read_text())
    assert meta["dtype"] == stats.dtype == "float32"  # auto keeps the checkpoint's own dtype
    assert meta["source_format"] == "hf" and meta["quantization"] is None and "config.json" in meta["files"]
    want = load_model(FIXTURES / "hf" / name, "float32", with_tokenizer=False)
    got = load_model(tmp_path / "ckpt", "float32", with_tokenizer=False)
    assert got.config == want.config
    _leaves_equal(got.params, want.params)
    assert stats.parameters == sum(x.size for x in jax.tree.leaves(want.params))


def test_converted_checkpoint_generates_the_golden_tokens(tmp_path):
    convert(LLAMA, tmp_path / "ckpt", dtype="float32", progress=False)
    llm = LLM(
        str(tmp_path / "ckpt"),
        "float32",
        max_model_len=128,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        token_buckets=[8, 64],
    )
    params = SamplingParams(temperature=0, max_tokens=GENERATE["max_new_tokens"], ignore_eos=True)
    outs = llm.generate(GENERATE["prompts"][:4], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == GENERATE["outputs"][:4]


def test_restore_casts_to_the_asked_dtype(tmp_path):
    convert(LLAMA, tmp_path / "ckpt", dtype="bfloat16", progress=False)
    got = load_model(tmp_path / "ckpt", "float32", with_tokenizer=False)
    want = load_model(LLAMA, "bfloat16", with_tokenizer=False)
    assert got.params.embed.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(got.params.embed), np.asarray(want.params.embed, np.float32))


def test_gguf_converts_with_config_and_tokenizer(tmp_path):
    """SmolLM2's GGUF: config.json and the exported tokenizer read back equal, and the restored
    weights reproduce transformers' greedy tokens (the golden of test_smollm2)."""
    dst = tmp_path / "smollm2"
    main(["convert", str(smollm2_gguf_path()), str(dst), "--dtype", "float32", "--quiet"])
    source = load_model(smollm2_gguf_path(), "float32", with_tokenizer=True)
    model = load_model(dst, "float32")
    assert model.config == source.config == ModelConfig.from_hf_file(dst / "config.json")
    text = "<|im_start|>user\nWhat is 2+2?<|im_end|>"
    assert model.tokenizer.encode(text) == source.tokenizer.encode(text)
    assert model.tokenizer.chat_template == source.tokenizer.chat_template
    assert model.tokenizer.eos_token_ids == source.tokenizer.eos_token_ids
    golden = np.load(FIXTURES / "smollm2" / "golden.npz")
    seq = SingleSequence(model.family, model.config, model.params, max_len=len(golden["input_ids"]) + 32)
    _, greedy = seq.greedy(golden["input_ids"], len(golden["greedy"]))
    assert greedy == golden["greedy"].tolist()


def test_config_round_trips_through_hf_dict():
    for name in ("llama3", "mistral", "qwen2", "tied_gqa3", "qwen3", "qwen3_tied", "mixtral", "qwen3_moe"):
        config = ModelConfig.from_hf_file(FIXTURES / "hf" / name / "config.json")
        assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config, name
    config = ModelConfig.from_hf_file(LLAMA / "config.json")
    factors = dataclasses.replace(config, rope_freq_factors=(1.0, 2.0) * (config.head_dim // 4))
    assert ModelConfig.from_hf_dict(factors.to_hf_dict()) == factors


def test_bad_inputs_are_named(tmp_path, capsys):
    dst = tmp_path / "ckpt"
    convert(LLAMA, dst, progress=False)
    with pytest.raises(FileExistsError, match="exists and is not an empty directory"):
        convert(LLAMA, dst, progress=False)
    with pytest.raises(CheckpointError, match="orbax checkpoint already"):
        convert(dst, tmp_path / "again", progress=False)
    assert main(["convert", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert "model path does not exist" in capsys.readouterr().err
    assert main(["convert", str(LLAMA), str(tmp_path / "out2"), "--mesh", "tensor=3"]) == 2
    assert "tensor=3" in capsys.readouterr().err


def test_half_written_and_mismatched_checkpoints(tmp_path):
    dst = tmp_path / "ckpt"
    convert(LLAMA, dst, progress=False)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(CheckpointError, match=r"missing tensors \(9\): layers.2.attn_norm"):
        load_model(dst, "float32", with_tokenizer=False)
    (dst / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(CheckpointError, match=r"layers.0.w_gate: expected \(64, 96\), found \(64, 128\)"):
        load_model(dst, "float32", with_tokenizer=False)
    (dst / METADATA_FILE).unlink()
    with pytest.raises(CheckpointError, match="half-written"):
        load_model(dst, "float32", with_tokenizer=False)
    shutil.rmtree(dst / "params")
    with pytest.raises(FileNotFoundError):  # config.json alone is neither format
        load_model(dst, "float32", with_tokenizer=False)
