"""`jaxinfer convert --lora`: an adapter merged into an orbax checkpoint computes what PEFT computes
with the adapter (its golden logits and greedy tokens), with no adapter at run time."""

import numpy as np
import pytest
from model_harness import SingleSequence
from testpaths import FIXTURES, smollm2_gguf_path

from checkpoints import CheckpointError
from jaxinfer.cli import main
from jaxinfer.convert import convert
from jaxinfer.loader import load_model
from jaxinfer.lora import AdapterError

LORA = FIXTURES / "lora"


@pytest.mark.parametrize("name", ["llama3_all_r8", "llama3_vocab_r8"])
def test_merged_checkpoint_matches_peft(tmp_path, name):
    """llama3_vocab_r8 adapts the embedding and the (untied) LM head too."""
    dst = tmp_path / "merged"
    assert main(["convert", str(FIXTURES / "hf" / "llama3"), str(dst), "--lora", str(LORA / name), "-q"]) == 0
    golden = np.load(LORA / name / "golden.npz")
    model = load_model(dst, dtype="float32", with_tokenizer=False)
    seq = SingleSequence(model.family, model.config, model.params, max_len=len(golden["prompt"]) + 40)
    logits, greedy = seq.greedy(golden["prompt"], len(golden["greedy"]))
    assert np.abs(logits - golden["logits"]).max() < 1e-3
    assert greedy == golden["greedy"].tolist()


def test_merge_refusals(tmp_path):
    with pytest.raises(CheckpointError, match="merged into HF safetensors checkpoints, not gguf"):
        convert(smollm2_gguf_path(), tmp_path / "a", lora=LORA / "llama3_all_r8", progress=False)
    with pytest.raises(AdapterError, match="another model"):
        convert(FIXTURES / "hf" / "qwen2", tmp_path / "b", lora=LORA / "llama3_all_r8", progress=False)
    with pytest.raises(AdapterError, match="ties its LM head to the embedding, so the adapter's embed_tokens cannot"):
        convert(FIXTURES / "hf" / "gemma3", tmp_path / "c", lora=LORA / "gemma3_vocab_r4", progress=False)


FAMILIES = {  # fixture: modules adapted (a mixture's experts are not)
    "gemma3": list(DIMS_OF := ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "gemma2": list(DIMS_OF),
    "qwen3": list(DIMS_OF),
    "mixtral": ["q_proj", "k_proj", "v_proj", "o_proj"],
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_slots_equal_the_merged_weights_in_every_family(tmp_path, name):
    """Gemma 2/3 (their own layers), Qwen3 (QK-norm), Mixtral (attention only): the model with the
    adapter in a slot computes what the checkpoint with the adapter merged computes."""
    from lora_adapters import write_random_adapter
    from lora_runs import InSlot, with_adapters

    from jaxinfer.lora import read_adapter
    from jaxinfer.lora.peft import module_shapes

    base = FIXTURES / "hf" / name
    model = load_model(base, dtype="float32", with_tokenizer=False)
    c = model.config
    path = write_random_adapter(
        tmp_path / "a",
        num_layers=c.num_layers,
        dims=module_shapes(c),
        target_modules=FAMILIES[name],
        r=4,
        lora_alpha=8,
        use_rslora=False,
        seed=3,
        scale=1.0,
    )
    convert(base, tmp_path / "merged", dtype="float32", lora=path, progress=False)
    merged = load_model(tmp_path / "merged", dtype="float32", with_tokenizer=False)
    params = with_adapters(model, {1: read_adapter(path, c, max_rank=8)}, max_loras=1, max_rank=8)
    prompt = np.arange(1, 40) * 7 % c.vocab_size
    want = SingleSequence(merged.family, c, merged.params, max_len=64).feed(prompt)
    got = SingleSequence(InSlot(model.family, 1), c, params, max_len=64).feed(prompt)
    plain = SingleSequence(model.family, c, model.params, max_len=64).feed(prompt)
    assert np.abs(got - want).max() < 1e-4 < np.abs(plain - want).max()
