"""Shared test set-up: makes the helper modules in tests/support importable from any test."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "support"))

from testpaths import FIXTURES, TESTS, sentencepiece_model_path, smollm2_gguf_path  # noqa: E402,F401


def pytest_addoption(parser):
    parser.addoption(
        "--kernels", choices=("auto", "interpret", "compiled"),
        default=None, help="how the Pallas kernel tests run: compiled on the present accelerator, "
        "in interpret mode, or auto (compiled where the kernel's platform is the backend); "
        "default from JAXINFER_KERNELS, else auto")


def pytest_configure(config):
    import os
    mode = config.getoption("--kernels") or os.environ.get("JAXINFER_KERNELS", "auto")
    os.environ["JAXINFER_KERNELS"] = mode  # read by tests/pallas_kernels (kernel_mode.py)
