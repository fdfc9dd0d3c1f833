"""LoRA forward passes against HF transformers + PEFT (golden files of tools/make_lora_reference.py):
random adapters over the tiny Llama and Qwen2 checkpoints (all seven modules at rank 8 with and
without rsLoRA, q|v only at rank 4, attention only over Qwen2's biases), the embedding and the
LM head adapted too (over Llama, its LM head untied and PEFT's copies of the base weights in
the file; over Gemma 3, its LM head tied and its embedding scaled) and a random rank-16 adapter
over SmolLM2-135M; logits within float32 tolerance, greedy tokens equal.

The model runs with the adapter in one slot of the stacked device slots (other slots empty, or
holding another adapter) and every token bound to that slot, as the engine's step binds them."""

import functools
import json

import numpy as np
import pytest
from lora_adapters import write_random_adapter
from lora_runs import InSlot, with_adapters
from model_harness import SingleSequence
from testpaths import FIXTURES, smollm2_gguf_path

from jaxinfer.config.lora import TARGET_MODULES
from jaxinfer.loader import load_model
from jaxinfer.lora import read_adapter

LORA = FIXTURES / "lora"
CASES = [
    ("llama3", "llama3_all_r8"),
    ("llama3", "llama3_all_r8_rslora"),
    ("llama3", "llama3_qv_r4"),
    ("qwen2", "qwen2_attn_r8"),
    ("llama3", "llama3_vocab_r8"),
    ("gemma3", "gemma3_vocab_r4"),
]
VOCAB = {"llama3_vocab_r8", "gemma3_vocab_r4"}


@functools.cache
def _model(name):
    return load_model(FIXTURES / "hf" / name, dtype="float32", with_tokenizer=False)


@pytest.mark.parametrize("base,name", CASES, ids=[c[1] for c in CASES])
def test_logits_and_greedy_match_peft(base, name):
    model = _model(base)
    golden = np.load(LORA / name / "golden.npz")
    adapter = read_adapter(LORA / name, model.config, max_rank=16)
    other = read_adapter(
        LORA / "llama3_qv_r4" if name != "llama3_qv_r4" else LORA / "llama3_all_r8", _model("llama3").config, 16
    )
    slots = {2: adapter} if base != "llama3" else {1: other, 2: adapter}  # a neighbour in another slot
    params = with_adapters(model, slots, targets=TARGET_MODULES if name in VOCAB else None)
    prompt = golden["prompt"]
    seq = SingleSequence(InSlot(model.family, 2), model.config, params, max_len=len(prompt) + 40)
    logits, greedy = seq.greedy(prompt, len(golden["greedy"]))
    assert np.abs(logits - golden["logits"]).max() < 1e-3
    np.testing.assert_array_equal(logits.argmax(-1), golden["logits"].argmax(-1))
    assert greedy == golden["greedy"].tolist()
    assert greedy != golden["base_greedy"].tolist()  # the adapter is what made the difference
    base_seq = SingleSequence(InSlot(model.family, 0), model.config, params, max_len=len(prompt) + 40)
    assert base_seq.greedy(prompt, len(golden["base_greedy"]))[1] == golden["base_greedy"].tolist()


def test_smollm2_rank16_adapter_matches_peft(tmp_path):
    spec = json.loads((LORA / "smollm2_r16.json").read_text())
    path = write_random_adapter(tmp_path / "smollm2_r16", **spec["adapter"])
    model = load_model(smollm2_gguf_path(), dtype="float32", with_tokenizer=False)
    adapter = read_adapter(path, model.config, max_rank=16)
    assert adapter.scale == spec["lora_scaling"]
    params = with_adapters(model, {1: adapter}, max_loras=1)
    prompt, greedy = spec["prompt"], spec["greedy"]
    family = InSlot(model.family, 1)
    whole = SingleSequence(family, model.config, params, max_len=len(prompt) + len(greedy))
    logits = whole.feed(prompt + greedy)  # teacher-forced over prompt + the golden continuation
    for where, ids, values in zip(spec["topk_positions"], spec["topk_ids"], spec["topk_logits"]):
        assert np.argsort(-logits[where])[0] == ids[0]
        np.testing.assert_allclose(logits[where][ids], values, atol=2e-3, rtol=0)
    assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == greedy  # each step's argmax is the next
    assert greedy != spec["base_greedy"]
