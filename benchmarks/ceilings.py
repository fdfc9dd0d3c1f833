"""What the device can do at most: memory copy rate and matmul rate, measured the same way.

Each figure is many iterations inside ONE jitted call (a fori_loop), timed around the call, so a
short operation is not charged the host's round trip (~0.1-0.2 ms per synchronised call on a GPU).
Copy rate counts bytes read + written. Rated figures for known device kinds print beside them.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

# Vendor figures: HBM bytes/s and dense bf16 FLOP/s.
RATED = {
    "NVIDIA H100 80GB HBM3": (3.35e12, 989e12),
    "NVIDIA H200": (4.8e12, 989e12),
    "TPU v5 lite": (819e9, 197e12),  # v5e
    "TPU v6 lite": (1640e9, 918e12),  # v6e (Trillium)
    "TPU v5p": (2765e9, 459e12),
}


def _timed(fn, *args, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def copy_rate(nbytes: int = 1 << 28, iters: int = 20, dtype=jnp.float32) -> float:
    """Bytes/s of x -> x + 1 over a `nbytes` array, `iters` times in one call (read + write)."""
    x = jnp.zeros((nbytes // jnp.dtype(dtype).itemsize,), dtype)
    loop = jax.jit(lambda x: jax.lax.fori_loop(0, iters, lambda i, y: y + 1, x))
    return 2 * nbytes * iters / _timed(loop, x)


def matmul_rate(n: int = 4096, iters: int = 10, dtype=jnp.bfloat16) -> float:
    """FLOP/s of an [n, n] x [n, n] matmul, `iters` times in one call."""
    a = jnp.ones((n, n), dtype) * 0.01
    loop = jax.jit(lambda a: jax.lax.fori_loop(0, iters, lambda i, y: (y @ a).astype(dtype), a))
    return 2 * n**3 * iters / _timed(loop, a)


def describe() -> dict:
    """Measured rates for the default device (sized down on the CPU), and the rated ones."""
    cpu = jax.default_backend() == "cpu"
    kind = jax.devices()[0].device_kind
    measured = {
        "copy_bytes_per_s": copy_rate(1 << (26 if cpu else 29), 5 if cpu else 20),
        "matmul_flops_per_s": matmul_rate(
            1024 if cpu else 8192, 3 if cpu else 10, jnp.float32 if cpu else jnp.bfloat16
        ),
    }
    rated = RATED.get(kind)
    return {
        "device": kind,
        **measured,
        "rated_bytes_per_s": rated and rated[0],
        "rated_flops_per_s": rated and rated[1],
    }
