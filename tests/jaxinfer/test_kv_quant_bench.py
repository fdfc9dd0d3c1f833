"""benchmarks/bench_quality.py: its teacher-forced scoring through the engine's paged cache equals
log-softmax of one whole forward, and a tiny run prints the table (an int8 KV row beside float)."""

import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from model_harness import SingleSequence
from testpaths import FIXTURES

from jaxinfer.config import EngineConfig
from jaxinfer.engine import Engine
from jaxinfer.loader import load_model

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import bench_quality  # noqa: E402


def test_chunked_scoring_equals_one_forward():
    model = load_model(FIXTURES / "hf" / "llama3", dtype="float32", with_tokenizer=False)
    ids = np.random.default_rng(3).integers(0, model.config.vocab_size, 150).astype(np.int32)
    runner = Engine(
        model,
        EngineConfig(
            num_pages=8, max_model_len=64, max_num_batched_tokens=16, token_buckets=(16,), compilation_cache_dir=None
        ),
        warm_up=False,
    ).worker
    logprobs, argmax = bench_quality.score(runner, ids, window=64, chunk=16)
    want_lp, want_argmax = [], []
    for w0 in range(0, len(ids) - 1, 64):  # windows of 64 scored tokens, each from a fresh cache
        seq = ids[w0 : w0 + 65]
        logits = SingleSequence(model.family, model.config, model.params, max_len=64).feed(seq[:-1])
        log_softmax = np.asarray(jax.nn.log_softmax(logits, axis=-1))
        want_lp.append(log_softmax[np.arange(len(seq) - 1), seq[1:]])
        want_argmax.append(logits.argmax(-1))
    assert len(logprobs) == len(ids) - 1
    np.testing.assert_allclose(logprobs, np.concatenate(want_lp), atol=1e-4)
    assert (argmax == np.concatenate(want_argmax)).mean() > 0.99


@pytest.mark.slow
def test_bench_quality_smoke(tmp_path):
    """SmolLM2 with an int8 KV cache on a tiny text, and a row the model cannot run."""
    text = tmp_path / "text.txt"
    text.write_text("In the beginning was the word, and the word was spoken softly by the river. " * 8)
    argv = [
        sys.executable,
        str(BENCHMARKS / "bench_quality.py"),
        "--text",
        str(text),
        "--tokens",
        "96",
        "--window",
        "48",
        "--chunk",
        "16",
        "--configs",
        "kv-int8,int4-g128",
        "--base",
        "kv-int8",
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {line.split("|")[1].strip(): line.split("|") for line in out.stdout.splitlines() if line.startswith("| ")}
    kv = rows["kv-int8"]
    assert kv[3].strip() == "int8" and kv[5].strip() == "+0.00%"
    assert 1 < float(kv[4]) < 20, out.stdout  # a repeated sentence: a low perplexity
    # SmolLM2's hidden size 576 is not a multiple of 128: the row says so instead of a number.
    assert "not run" in rows["int4-g128"][4] and "coarser grid" in rows["int4-g128"][4]  # a Q4_1 file: g32
