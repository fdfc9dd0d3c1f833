"""Makes rpa_cases / kernel_mode importable from the kernel tests, and marks every case of the
GPU kernel `gpu` and every case of the TPU kernel `tpu`: `pytest -m gpu --kernels compiled`
on a GPU machine runs the whole GPU suite compiled."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_tpu_interpreter():
    """A kernel that raises inside the TPU interpreter leaves state behind; clear it."""
    yield
    pltpu.reset_tpu_interpret_mode_state()


def _kernel_of(item) -> str | None:
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "kernel" in params:
        return params["kernel"]
    name = item.originalname if hasattr(item, "originalname") else item.name
    for kernel in ("gpu", "tpu"):
        if name.startswith(f"test_{kernel}_"):
            return kernel
    return None


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).parent != here:
            continue
        kernel = _kernel_of(item)
        if kernel in ("gpu", "tpu"):
            item.add_marker(getattr(pytest.mark, kernel))
