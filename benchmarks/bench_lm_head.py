"""The LM head's matmul at decode sizes, by weight layout: is a tied head slower?

On an H100 (2026-11-26) the 1B shape's tied LM head, the embedding [V, E] contracted on E, took
0.43 ms per decode step with XLA's Triton GEMM and 0.44 ms with cuBLAS: ~1.2 TB/s for its 525 MB,
where the 8B's untied head [E, V] and every other matmul of the step read at ~2.9 TB/s. This
times the contraction alone, each form many times inside one jitted call (as ceilings.py does),
for a few row counts:

- `tied x.W^T`: the engine's tied head (jaxinfer.quant.einsum "ne,ve->nv", the embedding as
  stored);
- `tied W.x^T`: the same weight, the product computed as [V, E] . [E, M] and transposed (the
  weight is the left operand, so a GEMV streams its rows);
- `untied x.W`: an [E, V] weight ("ne,ev->nv"), the layout of an untied head.

Each row prints ms per call and the weight bytes read per second beside the measured copy rate.

    python benchmarks/bench_lm_head.py                      # 1B and 8B heads, rows 1 8 64 256
    python benchmarks/bench_lm_head.py --smoke               # tiny, CPU
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ceilings  # noqa: E402

from jaxinfer.quant import einsum  # noqa: E402

FORMS = {
    "tied x.W^T": ("tied", lambda x, w: einsum("ne,ve->nv", x, w)),
    "tied W.x^T": ("tied", lambda x, w: jax.lax.dot_general(w, x, (((1,), (1,)), ((), ()))).T),
    "untied x.W": ("untied", lambda x, w: einsum("ne,ev->nv", x, w)),
}


def time_form(form, weight: jax.Array, rows: int, iters: int) -> float:
    """Seconds per call of `form` on [rows, E] activations, `iters` calls in one jitted loop;
    each call's input depends on the one before, so none is hoisted or skipped."""
    embed = weight.shape[1] if weight.shape[0] > weight.shape[1] else weight.shape[0]

    def body(i, x):
        logits = form(x, weight).astype(jnp.float32)  # as compute_logits returns them
        return x + (1e-6 * logits[:, :embed]).astype(x.dtype)

    loop = jax.jit(lambda x: jax.lax.fori_loop(0, iters, body, x))
    x = jnp.ones((rows, embed), weight.dtype) * 0.01
    return ceilings._timed(loop, x) / iters


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU)")
    parser.add_argument("--rows", type=int, nargs="+", default=None)
    parser.add_argument("--iters", type=int, default=None)
    args = parser.parse_args(argv)
    cpu = jax.default_backend() == "cpu"
    shapes = {"smoke": (4096, 256)} if args.smoke else {"llama-3.2-1b": (128256, 2048), "llama-3.1-8b": (128256, 4096)}
    rows = args.rows or ([1, 8] if args.smoke else [1, 8, 64, 256])
    iters = args.iters or (3 if args.smoke else 50)
    dtype = jnp.float32 if cpu and args.smoke else jnp.bfloat16
    ceil = ceilings.describe()
    copy = ceil["copy_bytes_per_s"]
    print(f"# LM head matmul on {ceil['device']} (jax {jax.__version__}), {jnp.dtype(dtype).name}")
    print(f"Measured copy rate {copy / 1e9:.1f} GB/s (read + write); weight bytes read per call over the time\n")
    print("| shape | form | rows | ms per call | weight GB/s | % of copy rate |")
    print("|---|---|---|---|---|---|")
    for name, (vocab, embed) in shapes.items():
        key = jax.random.key(0)
        weights = {"tied": jax.random.normal(key, (vocab, embed), dtype) * 0.02}
        weights["untied"] = weights["tied"].T.copy()  # [E, V], a real copy in that layout
        nbytes = vocab * embed * jnp.dtype(dtype).itemsize
        for label, (which, form) in FORMS.items():
            for m in rows:
                sec = time_form(form, weights[which], m, iters)
                print(
                    f"| {name} | {label} | {m} | {1e3 * sec:.4f} | {nbytes / sec / 1e9:.0f} | "
                    f"{100 * nbytes / sec / copy:.0f}% |",
                    flush=True,
                )
        del weights


if __name__ == "__main__":
    main()
