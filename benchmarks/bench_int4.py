"""The int4 matmul's forms side by side, for a GPU where the engine's form materializes its
unpacked weights (an H200, 2026-11-29: int4 g64 decode at 4.7x bf16's step time, most of it in
`input_concatenate_fusion`s writing the unpacked weights to HBM each step).

    python benchmarks/bench_int4.py                         # Llama-3.1-8B's MLP, 8 layers, batch 1 and 64
    python benchmarks/bench_int4.py --layers 1 --hidden 256 --ffn 512 --repeats 3   # a smoke run

Each form runs the same chain of `--layers` MLPs (gate|up [E, 2F], SiLU-gated, down [F, E]), each
layer its own weights, quantized once by the engine's own int4 (groups of --group inputs, float
offsets: w ~ q * s + o, two values a byte, the even input in the low nibble), jitted, timed as
loops (median of --repeats, each --calls calls then one wait):
  bf16      the dequantized weights stored as bfloat16 (the floor int4 has to beat)
  engine    jaxinfer.quant.einsum on the QuantizedWeight (what the engine runs)
  halves    no interleave: x's even inputs against the low nibbles, odd ones against the high,
            each a [n/2, out] operand computed elementwise from the bytes (scales broadcast)
  int4      the integers kept as jnp.uint4 [n, out], converted and scaled in the dot's operand
Prints ms per call, the weights' bytes over that time, the ratio to bf16 and each form's largest
difference from `engine`, over engine's largest output (bfloat16 rounding only).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxinfer.quant import einsum as quant_einsum  # noqa: E402
from jaxinfer.quant.config import QuantConfig, quantize_field  # noqa: E402
from jaxinfer.quant.weights import dequantize  # noqa: E402


def per_half(a: jax.Array, group: int) -> jax.Array:
    """[n/g, out] -> [n/2, out]: each group's row over its g/2 packed rows (a broadcast)."""
    return jnp.broadcast_to(a[:, None, :], (a.shape[0], group // 2, a.shape[1])).reshape(-1, a.shape[1])


def per_row(a: jax.Array, group: int) -> jax.Array:
    """[n/g, out] -> [n, out] by broadcast."""
    return jnp.broadcast_to(a[:, None, :], (a.shape[0], group, a.shape[1])).reshape(-1, a.shape[1])


def halves_matmul(x: jax.Array, w) -> jax.Array:
    s, o = per_half(w.scales, w.group), per_half(w.offsets, w.group)
    lo = (w.values & 0xF).astype(x.dtype) * s + o
    hi = (w.values >> 4).astype(x.dtype) * s + o
    return jnp.dot(x[:, 0::2], lo) + jnp.dot(x[:, 1::2], hi)


def int4_matmul(x: jax.Array, w, group: int) -> jax.Array:
    q, s, o = w
    return jnp.dot(x, q.astype(x.dtype) * per_row(s, group) + per_row(o, group))


def mlp_chain(matmul):
    def run(x, layers):
        for gate_up, down in layers:
            h = matmul(x, gate_up)
            f = h.shape[-1] // 2
            x = matmul(jax.nn.silu(h[:, :f]) * h[:, f:], down)
        return x

    return jax.jit(run)


def timed(fn, args, calls: int, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--group", type=int, default=64)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    e, f, g = args.hidden, args.ffn, args.group
    rng = np.random.default_rng(0)
    quant = QuantConfig("int4", group_size=g)
    forms: dict[str, list] = {"bf16": [], "engine": [], "halves": [], "int4": []}
    for _ in range(args.layers):
        pair = {name: [] for name in forms}
        for n, out in ((e, 2 * f), (f, e)):
            w = quantize_field(0.02 * rng.standard_normal((n, out), np.float32), "w", (0,), quant, jnp.bfloat16)
            w = w.map(jax.device_put)
            q = jnp.asarray(
                np.stack([np.asarray(w.values) & 0xF, np.asarray(w.values) >> 4], axis=1).reshape(n, out), jnp.uint4
            )
            pair["bf16"].append(dequantize(w, jnp.bfloat16))
            pair["engine"].append(w)
            pair["halves"].append(w)
            pair["int4"].append((q, w.scales, w.offsets))
        for name in forms:
            forms[name].append(tuple(pair[name]))
    matmuls = {
        "bf16": jnp.dot,
        "engine": lambda x, w: quant_einsum("tn,no->to", x, w),
        "halves": halves_matmul,
        "int4": lambda x, w: int4_matmul(x, w, g),
    }
    bf16_bytes = args.layers * 3 * e * f * 2
    int4_bytes = args.layers * 3 * e * f * (0.5 + 2 * 2 / g)  # nibbles + bf16 scales and offsets
    print(
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {time.strftime('%Y-%m-%d')}: {args.layers} MLPs "
        f"E={e} F={f}, int4 g{g} + offsets (bf16 {bf16_bytes / 2**30:.2f} GiB, int4 {int4_bytes / 2**30:.2f} GiB)"
    )
    print("| batch | form | ms per call | GB/s of its weights | / bf16 | max diff from engine / its max |")
    print("|---|---|---|---|---|---|")
    for b in args.batches:
        x = jnp.asarray(rng.standard_normal((b, e), np.float32), jnp.bfloat16)
        results = {}
        for name, layers in forms.items():
            fn = mlp_chain(matmuls[name])
            results[name] = (timed(fn, (x, layers), args.calls, args.repeats), fn(x, layers))
        ref = results["engine"][1].astype(jnp.float32)
        for name, (seconds, y) in results.items():
            nbytes = bf16_bytes if name == "bf16" else int4_bytes
            diff = float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
            print(
                f"| {b} | {name} | {1e3 * seconds:.3f} | {nbytes / seconds / 1e9:.0f} | "
                f"{seconds / results['bf16'][0]:.2f} | {diff:.3g} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
