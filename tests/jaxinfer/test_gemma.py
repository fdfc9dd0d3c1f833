"""The Gemma family (Gemma 2, Gemma 3 text) on tiny random checkpoints made by transformers:
logits and greedy tokens against HF's goldens (one device here; 8 simulated devices with
tensor=2 in subprocesses), the config's layer pattern / rope / soft caps, and bad configs."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
from gguf_builder import write_gguf
from model_harness import SingleSequence
from safetensors.numpy import load_file
from testpaths import FIXTURES, TESTS
from xla_env import child_env

from jaxinfer import cli
from jaxinfer.config import ConfigError, ModelConfig
from jaxinfer.convert import convert
from jaxinfer.llm import LLM
from jaxinfer.loader import load_model
from jaxinfer.models.gemma import model as gemma
from jaxinfer.sampling import SamplingParams

GEMMAS = ["gemma2", "gemma3"]


def _load(name: str):
    return load_model(FIXTURES / "hf" / name, dtype="float32", with_tokenizer=False), np.load(
        FIXTURES / "hf" / name / "golden.npz"
    )


@pytest.mark.parametrize("name", GEMMAS)
def test_logits_and_greedy_match_hf(name):
    model, golden = _load(name)
    prompt = golden["input_ids"]
    seq = SingleSequence(model.family, model.config, model.params, max_len=len(prompt) + 40)
    logits, greedy = seq.greedy(prompt, len(golden["greedy"]))
    assert np.abs(logits - golden["logits"]).max() < 1e-3
    np.testing.assert_array_equal(logits.argmax(-1), golden["logits"].argmax(-1))
    assert greedy == golden["greedy"].tolist()


@pytest.mark.parametrize("name", GEMMAS)
def test_chunked_prefill_across_the_window_equals_one_pass(name):
    """Chunks ending before, at and past the 8-token window, then decode steps: the paged cache of
    local layers serves the same logits as one pass."""
    model, golden = _load(name)
    prompt = golden["input_ids"]
    full = SingleSequence(model.family, model.config, model.params, max_len=64).feed(prompt)
    seq = SingleSequence(model.family, model.config, model.params, max_len=64, page_size=4)
    parts = [seq.feed(prompt[:5]), seq.feed(prompt[5:8]), seq.feed(prompt[8:19])]
    parts += [seq.feed(prompt[i : i + 1]) for i in range(19, 64)]
    np.testing.assert_allclose(np.concatenate(parts), full, atol=2e-5, rtol=0)


def test_configs_read_as_transformers_does():
    g3 = ModelConfig.from_hf_file(FIXTURES / "hf" / "gemma3" / "config.json")
    assert g3.family == "gemma" and g3.qk_norm and g3.tie_word_embeddings
    assert [g3.layer_window(i) for i in range(4)] == [8, 8, None, 8]
    assert (g3.rope_theta, g3.rope_scaling.rope_type, g3.rope_scaling.factor, g3.rope_local_theta) == (
        1e6,
        "linear",
        4.0,
        1e4,
    )
    assert g3.attn_scale == 32**-0.5 and g3.attn_logit_softcap is None and g3.final_logit_softcap is None
    g2 = ModelConfig.from_hf_file(FIXTURES / "hf" / "gemma2" / "config.json")
    assert [g2.layer_window(i) for i in range(3)] == [8, None, 8] and not g2.qk_norm
    assert (g2.attn_logit_softcap, g2.final_logit_softcap, g2.rope_local_theta) == (1.0, 10.0, None)
    for config in (g2, g3):
        assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config


def test_older_config_forms_give_the_same_config():
    """Pre-transformers-5 files: rope_theta / rope_local_base_freq / rope_scaling and a
    sliding_window_pattern instead of layer_types."""
    new = json.loads((FIXTURES / "hf" / "gemma3" / "config.json").read_text())
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types")}
    old.update(
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        sliding_window_pattern=3,
    )
    assert ModelConfig.from_hf_dict(old) == ModelConfig.from_hf_dict(new)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"hidden_activation": "silu"}, "hidden_activation 'silu'"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types="),
        ({"layer_types": ["sliding_attention", "global", "full_attention", "full_attention"]}, "'global'"),
        ({"sliding_window": None}, "sliding_window=None"),
        ({"final_logit_softcapping": -1.0}, "final_logit_softcapping=-1.0"),
        ({"model_type": "gemma3"}, "Gemma 3 with vision"),
    ],
)
def test_bad_configs_name_the_bad_value(change, message):
    cfg = {**json.loads((FIXTURES / "hf" / "gemma3" / "config.json").read_text()), **change}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        ModelConfig.from_hf_dict(cfg)


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def _gemma2_as_gguf(path):
    """The tiny Gemma 2 as llama.cpp's converter writes it: GGUF names, norm weights stored as
    1 + w, the soft caps and window in the metadata (the layer pattern is implied)."""
    cfg = json.loads((FIXTURES / "hf" / "gemma2" / "config.json").read_text())
    tensors = {}
    for name, w in load_file(FIXTURES / "hf" / "gemma2" / "model.safetensors").items():
        w = w + 1 if name.endswith("norm.weight") else w
        if name.startswith("model.layers."):
            layer, module = name[len("model.layers.") :].split(".", 1)
            module = module.removesuffix(".weight")
            tensors[f"blk.{layer}.{_GGUF_NAMES[module]}.weight"] = w
        else:
            tensors[
                {
                    "model.embed_tokens.weight": "token_embd.weight",
                    "model.norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight",
                }[name]
            ] = w
    meta = {
        f"gemma2.{k}": v
        for k, v in {
            "block_count": cfg["num_hidden_layers"],
            "context_length": cfg["max_position_embeddings"],
            "embedding_length": cfg["hidden_size"],
            "feed_forward_length": cfg["intermediate_size"],
            "attention.head_count": cfg["num_attention_heads"],
            "attention.head_count_kv": cfg["num_key_value_heads"],
            "attention.key_length": cfg["head_dim"],
            "attention.value_length": cfg["head_dim"],
            "attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"],
            "attention.sliding_window": cfg["sliding_window"],
            "attn_logit_softcapping": cfg["attn_logit_softcapping"],
            "final_logit_softcapping": cfg["final_logit_softcapping"],
            "rope.freq_base": 10000.0,
            "vocab_size": cfg["vocab_size"],
        }.items()
    }
    return write_gguf(path, "gemma2", meta, tensors)


def test_gguf_checkpoint_reads_as_the_hf_one(tmp_path):
    model = load_model(_gemma2_as_gguf(tmp_path / "gemma2.gguf"), dtype="float32", with_tokenizer=False)
    hf, golden = _load("gemma2")
    assert model.config.rms_norm_eps == pytest.approx(hf.config.rms_norm_eps)  # stored as float32
    assert dataclasses.replace(model.config, rms_norm_eps=hf.config.rms_norm_eps) == hf.config
    seq = SingleSequence(model.family, model.config, model.params, max_len=100)
    logits, greedy = seq.greedy(golden["input_ids"], len(golden["greedy"]))
    assert np.abs(logits - golden["logits"]).max() < 1e-3 and greedy == golden["greedy"].tolist()


@pytest.mark.parametrize("source", ["gemma3", "gemma2-gguf"])
def test_converted_checkpoint_generates_the_golden_tokens(tmp_path, source):
    """HF directory or GGUF -> `jaxinfer convert` -> orbax -> LLM(...).generate: HF's greedy tokens."""
    name = source.removesuffix("-gguf")
    src = _gemma2_as_gguf(tmp_path / "gemma2.gguf") if source.endswith("gguf") else FIXTURES / "hf" / name
    convert(src, tmp_path / "ckpt", progress=False)
    golden = np.load(FIXTURES / "hf" / name / "golden.npz")
    llm = LLM(
        str(tmp_path / "ckpt"),
        "float32",
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        token_buckets=[8, 64],
    )
    params = SamplingParams(temperature=0, max_tokens=len(golden["greedy"]), ignore_eos=True)
    out = llm.generate([golden["input_ids"].tolist()], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == golden["greedy"].tolist()


def test_info_shows_the_family_and_its_features(capsys):
    assert (
        cli.main(
            [
                "info",
                "--model",
                str(FIXTURES / "hf" / "gemma3"),
                "--dtype",
                "float32",
                "--num-pages",
                "8",
                "--max-model-len",
                "64",
            ]
        )
        == 0
    )
    described = json.loads(capsys.readouterr().out)
    model, kv = described["model"], described["kv_cache"]
    assert model["family"] == "gemma" and model["layer_types"][2] == "full_attention"
    # one cache shared by four groups of one layer: the full one holds the context, the sliding
    # ones a window of 8 and the largest step's tokens (pages of 16: all of the 64-token context)
    assert kv["caches"] == 1 and [(g["window"], g["layers"]) for g in kv["groups"]] == [
        (None, [2]),
        (8, [0]),
        (8, [1]),
        (8, [3]),
    ]
    assert [g["pages_per_sequence"] for g in kv["groups"]] == [4] * 4 and kv["max_concurrency"] == 0.44
    for feature in (
        "sliding window 8 on 3 of 4 layers",
        "QK-norm",
        "tied LM head",
        "scores scaled by 32^-1/2",
        "rope base 1e+06, linear scaling x4 (sliding layers: base 10000)",
    ):
        assert feature in model["features"]


def test_norms_scale_by_one_plus_weight_in_float32():
    x = np.array([[1.0, -2.0, 3.0, 0.5]], np.float32)
    w = np.array([0.0, 0.5, -1.0, 2.0], np.float32)
    want = x / np.sqrt(np.mean(x * x) + 1e-6) * (1.0 + w)
    np.testing.assert_allclose(np.asarray(gemma.rms_norm(x, w, 1e-6)), want, rtol=1e-6)


def _scenario(*args) -> dict:
    """tests/sharding/scenarios.py in a fresh process with 8 forced CPU devices."""
    env = child_env(JAXINFER_TEST_DEVICES="8")  # scenarios.py adds the device count
    proc = subprocess.run(
        [sys.executable, str(TESTS / "sharding" / "scenarios.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


@pytest.mark.parametrize("name", GEMMAS)
def test_tensor_parallel_engine_matches_hf(name):
    """The engine on a tensor=2 mesh of 8 simulated devices (1 KV head stored once per shard):
    greedy tokens equal HF's, nothing compiled after warm-up."""
    r = _scenario("engine", name, "tensor=2")
    assert r["mismatched"] == [] and r["recompiled"] == 0 and r["pools_empty"], r
    assert r["cache_shard_shape"][-2] == 2  # one KV head (K and V) per shard


def test_tensor_parallel_logits_match_single_device_and_hf():
    r = _scenario("logits", ";".join(f"{name}:tensor=2" for name in GEMMAS))
    for case, result in r.items():
        assert result["max_diff_single"] < 1e-4 and result["max_diff_hf"] < 1e-3, (case, result)
        assert result["argmax_equal"], (case, result)
