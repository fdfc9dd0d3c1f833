"""How the kernel tests run each kernel: compiled on its own accelerator, or interpreted.

`pytest --kernels compiled|interpret|auto` (or JAXINFER_KERNELS) sets the mode; auto compiles
a kernel where the backend is its platform and interprets it elsewhere. Compiled cases compare
against the XLA reference with float32 dots at full precision (the GPU's default would use TF32).
"""

from __future__ import annotations

import os

import jax
import pytest

PLATFORMS = {"gpu": "gpu", "tpu": "tpu"}  # kernel name -> backend it compiles for


def mode() -> str:
    return os.environ.get("JAXINFER_KERNELS", "auto")


def compiled(kernel: str) -> bool:
    """True to run `kernel` compiled; skips the test if compiled was asked off the platform."""
    native = jax.default_backend() == PLATFORMS[kernel]
    if mode() == "compiled" and not native:
        pytest.skip(
            f"--kernels compiled: the {kernel} kernel needs a {kernel.upper()} backend "
            f"(this one is {jax.default_backend()})"
        )
    return native and mode() != "interpret"


def interpret_only() -> None:
    """For tests of the interpreters themselves (race detection, DMA order)."""
    if mode() == "compiled":
        pytest.skip("an interpreter test; --kernels compiled runs compiled cases only")
