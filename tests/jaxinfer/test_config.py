import json
import subprocess
import sys

import pytest
from testpaths import TESTS

from jaxinfer.config import ConfigError, ModelConfig

BASE = dict(
    model_type="llama",
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
)


def test_old_and_new_rope_forms_agree():
    old = ModelConfig.from_hf_dict(
        {
            **BASE,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        }
    )
    new = ModelConfig.from_hf_dict(
        {
            **BASE,
            "rope_parameters": {
                "rope_theta": 500000.0,
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        }
    )
    assert old == new
    assert old.rope_scaling.rope_type == "llama3" and old.rope_theta == 500000.0


def test_default_rope_in_rope_parameters():
    cfg = ModelConfig.from_hf_dict({**BASE, "rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}})
    assert cfg.rope_scaling is None and cfg.rope_theta == 1e4


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "vocab_size", "rms_norm_eps"])
def test_missing_field_is_named(field):
    cfg = {**BASE, "rope_theta": 1e4}
    del cfg[field]
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf_dict(cfg)


def test_missing_rope_theta_is_named():
    with pytest.raises(ConfigError, match="rope_theta"):
        ModelConfig.from_hf_dict(BASE)


def test_unknown_architecture_is_named():
    with pytest.raises(ConfigError, match="'gpt_neox'"):
        ModelConfig.from_hf_dict({**BASE, "model_type": "gpt_neox", "rope_theta": 1e4})


def test_unsupported_rope_type_is_named():
    with pytest.raises(ConfigError, match="'yarn'"):
        ModelConfig.from_hf_dict({**BASE, "rope_theta": 1e4, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_bad_gqa_ratio():
    with pytest.raises(ConfigError, match="num_key_value_heads=3"):
        ModelConfig.from_hf_dict({**BASE, "rope_theta": 1e4, "num_key_value_heads": 3})


def test_qwen2_biases_and_window_flag():
    cfg = ModelConfig.from_hf_dict(
        {**BASE, "model_type": "qwen2", "rope_theta": 1e6, "sliding_window": 32, "use_sliding_window": False}
    )
    assert cfg.qkv_bias and not cfg.o_bias and cfg.sliding_window is None


def test_qwen3_qk_norm_head_dim_and_window():
    qwen3 = {
        **BASE,
        "model_type": "qwen3",
        "rope_theta": 1e6,
        "head_dim": 24,
        "sliding_window": 32,
        "use_sliding_window": False,
        "max_window_layers": 1,
    }
    cfg = ModelConfig.from_hf_dict(qwen3)
    assert cfg.qk_norm and cfg.head_dim == 24 and not (cfg.qkv_bias or cfg.o_bias)
    assert cfg.family == "llama" and cfg.sliding_window is None
    assert ModelConfig.from_hf_dict({**qwen3, "attention_bias": True}).o_bias  # all four biases, as Llama
    assert not ModelConfig.from_hf_dict({**BASE, "rope_theta": 1e4}).qk_norm
    # use_sliding_window slides the layers from max_window_layers on: all, none, or some.
    sliding = {**qwen3, "use_sliding_window": True}
    assert ModelConfig.from_hf_dict({**sliding, "max_window_layers": 0}).sliding_window == 32
    assert ModelConfig.from_hf_dict({**sliding, "max_window_layers": 2}).sliding_window is None
    with pytest.raises(ConfigError, match="sliding_window in 1 of 2 layers"):
        ModelConfig.from_hf_dict(sliding)
    windowed = ModelConfig.from_hf_dict({**sliding, "max_window_layers": 0})
    assert ModelConfig.from_hf_dict(windowed.to_hf_dict()) == windowed


def test_moe_fields_and_sparse_layers():
    mixtral = ModelConfig.from_hf_dict(
        {
            **BASE,
            "model_type": "mixtral",
            "rope_theta": 1e6,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "sliding_window": None,
        }
    )
    assert mixtral.family == "moe" and mixtral.norm_topk_prob and not mixtral.qk_norm
    assert mixtral.moe_intermediate_size == mixtral.intermediate_size and mixtral.num_experts == 8
    assert all(mixtral.is_moe_layer(i) for i in range(mixtral.num_layers))
    qwen = {
        **BASE,
        "model_type": "qwen3_moe",
        "rope_theta": 1e6,
        "num_hidden_layers": 6,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
        "sliding_window": 32,
        "use_sliding_window": False,
    }
    cfg = ModelConfig.from_hf_dict(qwen)
    assert cfg.qk_norm and not cfg.norm_topk_prob and cfg.sliding_window is None
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    with pytest.raises(ConfigError, match="num_experts_per_tok=5"):
        ModelConfig.from_hf_dict({**qwen, "num_experts_per_tok": 5})
    assert ModelConfig.from_hf_dict({**BASE, "rope_theta": 1e4}).num_experts == 0  # dense: no experts


def test_mistral_window_and_eos_list():
    cfg = ModelConfig.from_hf_dict(
        {**BASE, "model_type": "mistral", "rope_theta": 1e4, "sliding_window": 16, "eos_token_id": [2, 7]}
    )
    assert cfg.sliding_window == 16 and cfg.eos_token_ids == (2, 7)


def test_from_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        ModelConfig.from_hf_file(tmp_path / "nope" / "config.json")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_hf_file(bad)
    bad.write_text(json.dumps({**BASE, "rope_theta": 1e4}))
    assert ModelConfig.from_hf_file(bad).num_layers == 2


def test_gguf_metadata():
    meta = {
        "general.architecture": "llama",
        "llama.block_count": 2,
        "llama.embedding_length": 64,
        "llama.feed_forward_length": 128,
        "llama.attention.head_count": 8,
        "llama.attention.head_count_kv": 2,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.context_length": 256,
        "llama.rope.freq_base": 1e4,
        "llama.vocab_size": 100,
    }
    cfg = ModelConfig.from_gguf_metadata(meta, has_output_weight=False)
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.tie_word_embeddings) == (2, 2, 8, True)
    with pytest.raises(ConfigError, match="'rwkv6'"):
        ModelConfig.from_gguf_metadata({**meta, "general.architecture": "rwkv6"})
    del meta["llama.block_count"]
    with pytest.raises(ConfigError, match="llama.block_count"):
        ModelConfig.from_gguf_metadata(meta)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"num_attention_heads": 0}, "not divisible by 0 attention heads"),
        ({"num_attention_heads": 5}, "hidden size 64 is not divisible by 5"),
        ({"vocab_size": 0}, "ModelConfig.vocab_size=0 must be a positive integer"),
        ({"num_hidden_layers": -1}, "ModelConfig.num_layers=-1 must be a positive integer"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
    ],
)
def test_impossible_shapes_are_named_not_divided_by(change, match):
    base = dict(
        model_type="llama",
        vocab_size=10,
        hidden_size=64,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=4,
        rms_norm_eps=1e-5,
        rope_theta=1e4,
        max_position_embeddings=32,
    )
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_dict({**base, **change})


def test_reading_configs_of_every_family_imports_no_jax():
    """Config reading loads each family's description (jaxinfer/models/<family>/__init__.py and
    config.py), never its model code: a fresh interpreter that has read and written back a config
    of every built-in family has not loaded JAX."""
    code = (
        "import sys; from jaxinfer.config import ModelConfig, families; "
        "[ModelConfig.from_hf_file(f'tests/fixtures/hf/{name}/config.json').to_hf_dict() "
        "for name in ('llama3', 'mixtral', 'gemma3')]; "
        "jax = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')); "
        "print(sorted(families._specs()), jax)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=TESTS.parent)
    assert out.stdout.strip() == "['gemma', 'llama', 'moe'] []"
