"""A model family from outside the package: ToyLlama (tests/support/toy_family), added with
`register_family` and nothing else, read from its own config.json and tensor names and served by
`LLM(path)`. What runs is checked against Llama on the same weights: with ToyLlama's residual
scale folded into the output projections the two agree, and without it they differ."""

import json

import numpy as np
import pytest
import toy_family
from model_harness import SingleSequence
from safetensors.numpy import save_file

from jaxinfer.config import ConfigError, ModelConfig, families
from jaxinfer.config.families import FamilySpec
from jaxinfer.llm import LLM
from jaxinfer.loader import load_model
from jaxinfer.models.registry import get_family, register_family
from jaxinfer.sampling import SamplingParams

E, F, V, H, K, D, LAYERS = 32, 64, 96, 4, 2, 8, 2
CONFIG = dict(
    vocab_size=V,
    hidden_size=E,
    intermediate_size=F,
    num_hidden_layers=LAYERS,
    num_attention_heads=H,
    num_key_value_heads=K,
    head_dim=D,
    rms_norm_eps=1e-5,
    max_position_embeddings=128,
    rope_theta=1e4,
    tie_word_embeddings=False,
    eos_token_id=0,
)
PROMPT = [3, 17, 42, 5, 88, 23, 61, 9, 14, 70, 33]
# HF module (model.layers.{i}.) -> ToyLlama's name (blocks.{i}.)
TOY_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "mlp_norm",
    "self_attn.q_proj": "attn.q",
    "self_attn.k_proj": "attn.k",
    "self_attn.v_proj": "attn.v",
    "self_attn.o_proj": "attn.out",
    "mlp.gate_proj": "mlp.gate",
    "mlp.up_proj": "mlp.up",
    "mlp.down_proj": "mlp.down",
}


@pytest.fixture
def registered(monkeypatch):
    """ToyLlama registered for one test; the catalog is as it was afterwards."""
    monkeypatch.setattr(families, "_SPECS", dict(families._specs()))
    register_family(toy_family.FAMILY)


def _llama_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """A random Llama under HF's names, projections [out, in]."""
    rng = np.random.default_rng(seed)

    def w(*shape, std=0.2):
        return rng.normal(0.0, std, shape).astype(np.float32)

    weights = {
        "model.embed_tokens.weight": w(V, E, std=1.0),
        "model.norm.weight": 1 + w(E, std=0.1),
        "lm_head.weight": w(V, E),
    }
    for i in range(LAYERS):
        shapes = {
            "input_layernorm": (E,),
            "post_attention_layernorm": (E,),
            "self_attn.q_proj": (H * D, E),
            "self_attn.k_proj": (K * D, E),
            "self_attn.v_proj": (K * D, E),
            "self_attn.o_proj": (E, H * D),
            "mlp.gate_proj": (F, E),
            "mlp.up_proj": (F, E),
            "mlp.down_proj": (E, F),
        }
        weights.update(
            {f"model.layers.{i}.{m}.weight": 1 + w(*s, std=0.1) if len(s) == 1 else w(*s) for m, s in shapes.items()}
        )
    return weights


def _as_toy(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The same weights under ToyLlama's names, matrices [in, out] (the embedding [V, E] as ever)."""
    toy = {
        "tok_embeddings": weights["model.embed_tokens.weight"],
        "norm": weights["model.norm.weight"],
        "output": weights["lm_head.weight"].T,
    }
    for name, w in weights.items():
        if name.startswith("model.layers."):
            layer, module = name.removeprefix("model.layers.").removesuffix(".weight").split(".", 1)
            toy[f"blocks.{layer}.{TOY_NAMES[module]}"] = w.T
    return toy


def _folded(weights: dict[str, np.ndarray], scale: float) -> dict[str, np.ndarray]:
    """Llama weights computing what ToyLlama computes: each residual branch ends in o_proj or
    down_proj, so scaling those scales the branch."""
    return {
        n: w * np.float32(scale) if n.endswith(("o_proj.weight", "down_proj.weight")) else w for n, w in weights.items()
    }


def _write(path, model_type: str, tensors: dict[str, np.ndarray]):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**CONFIG, "model_type": model_type}))
    save_file({n: np.ascontiguousarray(w) for n, w in tensors.items()}, str(path / "model.safetensors"))
    return path


def test_llm_generates_from_a_registered_family(registered, tmp_path):
    weights = _llama_weights()
    toy = _write(tmp_path / "toy", "toyllama", _as_toy(weights))
    folded = _write(tmp_path / "folded", "llama", _folded(weights, toy_family.RESIDUAL_SCALE))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    outputs = {}
    for name, path in (("toy", toy), ("folded", folded)):
        llm = LLM(
            str(path), "float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, token_buckets=[8, 16]
        )
        outputs[name] = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert outputs["toy"].token_ids == outputs["folded"].token_ids
    np.testing.assert_allclose(
        [lp.logprob for lp in outputs["toy"].logprobs], [lp.logprob for lp in outputs["folded"].logprobs], atol=1e-4
    )


def test_the_scaled_residuals_are_what_runs(registered, tmp_path):
    """Without the scale folded in, Llama on the same weights gives other logits: the
    agreement above is ToyLlama's own forward pass at work."""
    weights = _llama_weights()
    toy = load_model(_write(tmp_path / "toy", "toyllama", _as_toy(weights)), "float32", with_tokenizer=False)
    plain = load_model(_write(tmp_path / "plain", "llama", weights), "float32", with_tokenizer=False)
    assert toy.config.family == "toyllama" and toy.family is get_family("toyllama")
    assert toy.family.traits == ("residual branches scaled by 0.5",)
    np.testing.assert_array_equal(toy.params.embed, plain.params.embed)  # its own names, the same tensors
    logits = [SingleSequence(m.family, m.config, m.params, max_len=16).feed(PROMPT) for m in (toy, plain)]
    assert np.abs(logits[0] - logits[1]).max() > 0.1


def test_a_registered_family_reads_and_writes_its_config(registered):
    config = ModelConfig.from_hf_dict({**CONFIG, "model_type": "toyllama"})
    assert config.family == "toyllama" and config.to_hf_dict()["architectures"] == ["ToyLlamaForCausalLM"]
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
    with pytest.raises(ValueError, match="'toyllama' is registered already"):
        register_family(toy_family.FAMILY)
    with pytest.raises(ValueError, match="HF model_type 'qwen2' is served by family 'llama' already"):
        register_family(FamilySpec(name="other", model=toy_family.model_code, hf_architectures={"qwen2": "Qwen2"}))


def test_a_family_whose_model_code_is_not_a_model_family_is_refused(registered):
    register_family(FamilySpec(name="broken", model=lambda: "not a family", hf_architectures={"broken": "B"}))
    with pytest.raises(ValueError, match="model family 'broken': its model\\(\\) returned 'not a family'"):
        get_family("broken")
    with pytest.raises(ValueError, match="FamilySpec 'x': model=None must be a function"):
        FamilySpec(name="x", model=None, hf_architectures={})


def test_without_registration_the_model_type_is_unsupported():
    with pytest.raises(ConfigError, match="unsupported model_type 'toyllama'"):
        ModelConfig.from_hf_dict({**CONFIG, "model_type": "toyllama"})
    with pytest.raises(ValueError, match="unknown model family 'toyllama'"):
        get_family("toyllama")
