"""Makes rpa_cases (the random ragged-batch builder) importable from the kernel tests."""
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
