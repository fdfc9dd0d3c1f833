"""Our Llama-family (Llama, Mistral, Qwen2, Qwen3) and MoE-family (Mixtral, Qwen3-MoE) forward
passes against HF transformers' golden logits and greedy tokens."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf_builder import moe_hf_to_gguf, write_gguf
from model_harness import SingleSequence
from safetensors.numpy import load_file
from testpaths import FIXTURES

from jaxinfer.config import ModelConfig
from jaxinfer.loader import load_model
from jaxinfer.models import experts
from jaxinfer.quant import unstack

HF_MODELS = ["llama3", "mistral", "qwen2", "tied_gqa3", "qwen3", "qwen3_tied", "mixtral", "qwen3_moe"]


def _load(name: str):
    model = load_model(FIXTURES / "hf" / name, dtype="float32", with_tokenizer=False)
    golden = np.load(FIXTURES / "hf" / name / "golden.npz")
    return model, golden


@pytest.mark.parametrize("name", HF_MODELS)
def test_logits_and_greedy_match_hf(name):
    model, golden = _load(name)
    prompt = golden["input_ids"]
    seq = SingleSequence(model.family, model.config, model.params, max_len=len(prompt) + 40)
    logits, greedy = seq.greedy(prompt, len(golden["greedy"]))
    assert np.abs(logits - golden["logits"]).max() < 1e-3
    np.testing.assert_array_equal(logits.argmax(-1), golden["logits"].argmax(-1))
    assert greedy == golden["greedy"].tolist()


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_per_expert_layout_matches_hf(name):
    """The layout the runner computes with on one CPU device (experts unstacked: a switch per
    choice for the one-token steps, a conditional per expert for the prompt) against HF's goldens."""
    model, golden = _load(name)
    params = model.family.compute_layout(model.params, None)
    sparse = [layer for layer in params.layers if layer.experts_gate_up is not None]
    assert sparse and all(isinstance(layer.experts_gate_up, tuple) for layer in sparse)
    prompt = golden["input_ids"]
    seq = SingleSequence(model.family, model.config, params, max_len=len(prompt) + 40)
    logits, greedy = seq.greedy(prompt, len(golden["greedy"]))
    assert np.abs(logits - golden["logits"]).max() < 1e-3
    assert greedy == golden["greedy"].tolist()
    restacked = model.family.compute_layout(params, mesh="any mesh")  # a mesh computes stacked
    for a, b in zip(jax.tree.leaves(restacked), jax.tree.leaves(model.params), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name,arch", [("mixtral", "llama"), ("qwen3_moe", "qwen3moe")])
def test_moe_gguf_reads_as_the_hf_checkpoint(tmp_path, name, arch):
    """Mixtral and Qwen3-MoE converted as llama.cpp does (experts stacked per projection; Mixtral as
    architecture "llama" with rotary rows permuted; Qwen3-MoE's dense layer 1 a layer without a
    router): the same config and HF's golden logits and tokens."""
    cfg = json.loads((FIXTURES / "hf" / name / "config.json").read_text())
    meta, tensors = moe_hf_to_gguf(cfg, load_file(FIXTURES / "hf" / name / "model.safetensors"), arch)
    path = write_gguf(tmp_path / f"{name}.gguf", arch, meta, tensors)
    model, (hf, golden) = load_model(path, dtype="float32"), _load(name)
    assert model.tokenizer is None  # a GGUF without a vocabulary loads for token-id prompts
    assert model.config.family == "moe" and model.config.model_type == name
    keep = ("rms_norm_eps", "bos_token_id", "eos_token_ids", "sliding_window", "decoder_sparse_step")
    assert dataclasses.replace(model.config, **{k: getattr(hf.config, k) for k in keep}) == hf.config
    seq = SingleSequence(model.family, model.config, model.params, max_len=len(golden["input_ids"]) + 40)
    logits, greedy = seq.greedy(golden["input_ids"], len(golden["greedy"]))
    assert np.abs(logits - golden["logits"]).max() < 1e-3 and greedy == golden["greedy"].tolist()


@pytest.mark.parametrize("name", ["llama3", "mistral"])
def test_prefill_then_decode_equals_full_forward(name):
    model, golden = _load(name)
    prompt = golden["input_ids"]
    full = SingleSequence(model.family, model.config, model.params, max_len=64).feed(prompt)
    seq = SingleSequence(model.family, model.config, model.params, max_len=64)
    # Chunks that start and end mid-page, then single-token decode steps.
    parts = [seq.feed(prompt[:20]), seq.feed(prompt[20:37])]
    parts += [seq.feed(prompt[i : i + 1]) for i in range(37, 64)]
    np.testing.assert_allclose(np.concatenate(parts), full, atol=2e-5, rtol=0)


@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_grouped_matmuls_equal_the_dense_form(renormalize):
    """moe_mlp's "ragged" path (tokens sorted by expert, lax.ragged_dot) and its per-expert forms
    against its "dense" one (every expert on every token, zero weight off the top k), on odd token
    counts."""
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(keys[0], (71, 48))
    router = jax.random.normal(keys[1], (48, 8))
    w_gate_up, w_down = 0.1 * jax.random.normal(keys[2], (8, 48, 2, 24)), 0.1 * jax.random.normal(keys[3], (8, 24, 48))
    out = {
        impl: experts.moe_mlp(x, router, w_gate_up, w_down, top_k=3, renormalize=renormalize, impl=impl)
        for impl in ("dense", "ragged", "capacity")
    }
    np.testing.assert_allclose(out["ragged"], out["dense"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(out["capacity"], out["dense"], atol=1e-5, rtol=0)
    for t in (1, 2, 37, 71):  # per expert: a switch per choice under 64 tokens, else conditionals
        per_expert = jax.jit(
            lambda x: experts.moe_mlp(x, router, unstack(w_gate_up), unstack(w_down), top_k=3, renormalize=renormalize)
        )
        np.testing.assert_allclose(per_expert(x[:t]), out["dense"][:t], atol=1e-5, rtol=0)
    weights, _ = experts.route(x, router, 3, renormalize)
    assert np.allclose(weights.sum(-1), 1.0) == renormalize


def test_moe_forms_run_vmapped_over_data_replicas():
    """The runner vmaps its step over data replicas. lax.ragged_dot cannot be vmapped with
    weights the replicas share, so the ragged form runs the replicas' tokens as rows of one call
    (and weights that differ per replica one replica after another): each form vmapped equals
    its calls one replica at a time."""
    keys = jax.random.split(jax.random.PRNGKey(1), 5)
    x = jax.random.normal(keys[0], (3, 13, 48))  # [replicas, T, E]
    router = jax.random.normal(keys[1], (48, 8))
    w_gate_up, w_down = 0.1 * jax.random.normal(keys[2], (8, 48, 2, 24)), 0.1 * jax.random.normal(keys[3], (8, 24, 48))
    for impl in ("ragged", "dense", "capacity"):
        mlp = lambda x, w1=w_gate_up, w2=w_down, impl=impl: experts.moe_mlp(  # noqa: E731
            x, router, w1, w2, top_k=3, renormalize=True, impl=impl
        )
        one_by_one = np.stack([mlp(x[r]) for r in range(3)])
        np.testing.assert_allclose(jax.jit(jax.vmap(mlp))(x), one_by_one, atol=1e-5, rtol=0)
    weights, chosen = jax.vmap(lambda x: experts.route(x, router, 3, True))(x)  # per replica its choices
    shared_rows = jax.vmap(experts.ragged_experts, in_axes=(None, 0, 0, None, None))(
        x[1], weights, chosen, w_gate_up, w_down
    )
    np.testing.assert_allclose(
        shared_rows,
        np.stack([experts.ragged_experts(x[1], weights[r], chosen[r], w_gate_up, w_down) for r in range(3)]),
        atol=1e-5,
        rtol=0,
    )
    per_replica = jnp.stack([w_gate_up, 2 * w_gate_up, -w_gate_up])
    mlp = lambda x, w1: experts.moe_mlp(x, router, w1, w_down, top_k=3, renormalize=True, impl="ragged")  # noqa: E731
    np.testing.assert_allclose(
        jax.vmap(mlp)(x, per_replica), np.stack([mlp(x[r], per_replica[r]) for r in range(3)]), atol=1e-5, rtol=0
    )


def test_moe_auto_form_follows_the_meshs_platform():
    """ "auto" picks the form of the platform the step is built for: a step traced here for TPU
    chips (benchmarks/tpu_aot.py) runs the grouped matmuls a TPU would, not the CPU's dense form."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    x, router = jnp.zeros((4, 48)), jnp.zeros((48, 8))
    w_gate_up, w_down = jnp.zeros((8, 48, 2, 24)), jnp.zeros((8, 24, 48))
    trace = lambda: str(
        jax.make_jaxpr(
            lambda x: experts.moe_mlp(  # noqa: E731
                x, router, w_gate_up, w_down, top_k=2, renormalize=True
            )
        )(x)
    )
    assert "ragged_dot" not in trace()  # the CPU's own: dense
    tpu = AbstractMesh(
        (1,),
        ("tensor",),
        (AxisType.Auto,),
        abstract_device=AbstractDevice(device_kind="TPU v5 lite", num_cores=None, platform="tpu"),
    )
    with jax.sharding.use_abstract_mesh(tpu):
        assert "ragged_dot" in trace()


@pytest.mark.parametrize(
    "tokens,num_experts,skew", [(1, 32, 0.0), (5, 32, 0.0), (11, 32, 0.0), (300, 16, 0.0), (300, 16, 8.0)]
)
def test_capacity_form_equals_the_dense_form(tokens, num_experts, skew):
    """The capacity form's three shapes against the dense form: few experts chosen (T * k * 3 <
    X: only their weights gathered), every expert at C = T (up to 128 tokens), and past 128
    tokens C a few times the mean group, or C = T under the conditional when a router skewed
    towards expert 0 fills its group past that (then every token chooses it)."""
    keys = jax.random.split(jax.random.PRNGKey(tokens), 4)
    x = jax.random.normal(keys[0], (tokens, 48)) + (2.0 if skew else 0.0)
    router = jax.random.normal(keys[1], (48, num_experts)).at[:, 0].add(skew)
    w_gate_up = 0.1 * jax.random.normal(keys[2], (num_experts, 48, 2, 24))
    w_down = 0.1 * jax.random.normal(keys[3], (num_experts, 24, 48))
    mlp = jax.jit(
        lambda impl: experts.moe_mlp(x, router, w_gate_up, w_down, top_k=2, renormalize=True, impl=impl),
        static_argnums=0,
    )
    np.testing.assert_allclose(mlp("capacity"), mlp("dense"), atol=1e-5, rtol=0)
    _, chosen = experts.route(x, router, 2, True)
    largest = int(np.bincount(np.asarray(chosen).reshape(-1), minlength=num_experts).max())
    small = experts.next_pow2(-(-4 * tokens * 2 // num_experts))
    assert (largest > small) == (skew > 0) or tokens <= experts._EXACT_TOKENS, (largest, small)


def test_legacy_config_matches_new_form():
    legacy = ModelConfig.from_hf_file(FIXTURES / "hf" / "legacy_config.json")
    new = ModelConfig.from_hf_file(FIXTURES / "hf" / "llama3" / "config.json")
    assert legacy == new


def test_bfloat16_close_to_float32():
    model32, golden = _load("llama3")
    model16 = load_model(FIXTURES / "hf" / "llama3", dtype="bfloat16", with_tokenizer=False)
    prompt = golden["input_ids"]
    l32 = SingleSequence(model32.family, model32.config, model32.params, max_len=64).feed(prompt)
    l16 = SingleSequence(model16.family, model16.config, model16.params, max_len=64).feed(prompt)
    assert model16.params.embed.dtype.name == "bfloat16"
    scale = np.abs(l32).max()
    assert np.abs(l16 - l32).max() < 0.05 * scale
    assert (l16.argmax(-1) == l32.argmax(-1)).mean() > 0.9


def test_capacity_form_lowers_for_cuda():
    """The GPU's default MoE form lowers for CUDA from the CPU (no device): its conditional and
    batched matmuls, with no ragged_dot left for XLA:GPU to compute densely."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    gpu = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=gpu)
    f = jax.jit(
        lambda x, router, w1, w2: experts.moe_mlp(x, router, w1, w2, top_k=8, renormalize=True, impl="capacity")
    )
    shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((256, 64), (64, 128), (128, 64, 2, 32), (128, 32, 64))]
    with jax.sharding.use_abstract_mesh(mesh):
        text = f.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.case" in text or "stablehlo.if" in text  # past 128 tokens: the conditional
    assert "ragged_dot" not in text and text.count("stablehlo.dot_general") >= 4  # both branches
