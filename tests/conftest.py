"""Shared test set-up: makes the helper modules in tests/support importable from any test."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "support"))

from testpaths import FIXTURES, TESTS, sentencepiece_model_path, smollm2_gguf_path  # noqa: E402,F401
