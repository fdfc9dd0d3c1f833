"""Ragged paged attention on one GPU or TPU: our Pallas kernel vs the XLA reference vs jax's
shipped kernel: `jax.experimental.pallas.ops.gpu.paged_attention` on a GPU (decode only),
`jax.experimental.pallas.ops.tpu.ragged_paged_attention` on a TPU (skipped if not importable).
Where our kernel splits the batch at run time (TPU: decode / mixed / prefill paths; GPU: the
decode tokens of a prefill-like batch in a call of their own) it runs twice: as it ships and as
one call over the whole batch (`default_config`), so the split's gain is measured in one run.

    python benchmarks/bench_attention.py                  # on a GPU (H100/H200) or a TPU
    python benchmarks/bench_attention.py --smoke          # CPU: tiny shapes, kernels interpreted
    python benchmarks/bench_attention.py --smoke --kernel tpu   # the TPU rows, interpreted
    python benchmarks/bench_attention.py --scenarios decode --batches 1,64 --contexts 4096
    python benchmarks/bench_attention.py --sweep          # + the default config's neighbours
    python benchmarks/bench_attention.py --profile        # + where each row's device time goes

How it measures:
- Device ceilings first (benchmarks/ceilings.py): HBM bandwidth from 20 copies of 512 MiB
  (x + 1, bytes read + written) and bf16 FLOP/s from 10 8192^3 matmuls, each loop inside one
  jitted call; the device kind's rated figures print beside them.
- Every row first checks correctness: each implementation runs once on a copy of the batch and
  its output is compared with the reference's (max |err| column; "FAIL" if over tolerance).
- Timing: the call repeated inside one jitted fori_loop (~5 ms per timed call) with the KV
  cache donated and threaded through (so the KV write is in place, as in the engine), warm-up
  calls, then the median per iteration over repeated calls: no host round trip is charged.
  Our kernel and the reference include the KV write of the new tokens; jax's kernels do not
  write (the GPU one reads a separate [Hkv, P, page, D] copy of the same cache, the TPU one the
  written cache itself).
- Decode rows report achieved HBM GB/s = K+V bytes of all sequences' contexts / time (q, out and
  the write are ignored, <1%); prefill rows report TFLOP/s = 4 * Hq * D * (keys attended, causal)
  / time. Both are also given as % of the measured ceiling.
- `--profile`: each row's timed loop is traced once more (`jax.profiler`) and a second table
  lists the device kernels that took most of its time, per call: the attention kernel itself
  against the XLA work around it (work list, gathers, combine).
Results go to stdout as markdown tables.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from pallas_kernels import common, gpu, gpu_config, gpu_tuned, tpu, tpu_blocks  # noqa: E402
from pallas_kernels.reference import ragged_paged_attention_reference  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ceilings  # noqa: E402
import profile_idle  # noqa: E402

try:  # deprecated in jax, may disappear
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged
except Exception:  # noqa: BLE001
    jax_paged = None
try:
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as jax_rpa
except Exception:  # noqa: BLE001
    jax_rpa = None


@dataclasses.dataclass
class Model:
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: object


@dataclasses.dataclass
class Batch:
    name: str
    shape: str
    args: tuple  # q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs
    q_lens: np.ndarray
    kv_lens: np.ndarray
    kv_bytes: int  # K+V bytes of every sequence's context
    flops: int  # 4 * Hq * D * attended keys
    decode: bool


def make_batch(name, q_lens, kv_lens, model: Model, seed=0) -> Batch:
    rng = np.random.default_rng(seed)
    q_lens, kv_lens = np.asarray(q_lens, np.int32), np.asarray(kv_lens, np.int32)
    page = model.page_size
    pages_needed = -(-kv_lens // page)
    pages_per_seq = int(pages_needed.max())
    num_pages = int(pages_needed.sum()) + 1  # page 0: the null page
    owned = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    page_indices = np.zeros((len(q_lens), pages_per_seq), np.int32)
    offsets = np.concatenate([[0], np.cumsum(pages_needed)])
    for s in range(len(q_lens)):
        page_indices[s, : pages_needed[s]] = owned[offsets[s] : offsets[s + 1]]
    num_tokens = int(q_lens.sum())
    keys = jax.random.split(jax.random.key(seed), 4)
    hq, hkv, d = model.q_heads, model.kv_heads, model.head_dim
    q = jax.random.normal(keys[0], (num_tokens, hq, d), model.dtype)
    k = jax.random.normal(keys[1], (num_tokens, hkv, d), model.dtype)
    v = jax.random.normal(keys[2], (num_tokens, hkv, d), model.dtype)
    cache = jax.random.normal(keys[3], (num_pages, page, 2 * hkv, d), model.dtype)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    args = (
        q,
        k,
        v,
        cache,
        jnp.asarray(kv_lens),
        jnp.asarray(page_indices),
        jnp.asarray(cu),
        jnp.asarray([len(q_lens)], jnp.int32),
    )
    itemsize = jnp.dtype(model.dtype).itemsize
    kv_bytes = int(kv_lens.sum()) * 2 * hkv * d * itemsize
    attended = sum(int(sum(range(kl - ql + 1, kl + 1))) for ql, kl in zip(q_lens, kv_lens))
    return Batch(name, "", args, q_lens, kv_lens, kv_bytes, 4 * hq * d * attended, bool((q_lens == 1).all()))


def _device_profile(looped, carry, steps: int):
    """(carry, report): two timed calls under jax.profiler; the report's busy time and top
    device kernels in seconds per step, or a note where the trace has no device kernels."""

    def run(carry=carry):
        for _ in range(2):
            carry = jax.block_until_ready(looped(carry))
        return carry

    carry, report = profile_idle.traced(run, f"/device:{jax.default_backend().upper()}")
    if report is None:
        return carry, "no device kernels in the trace"
    per = 2 * steps
    return carry, {"busy_s": report["busy_s"] / per, "top": [(n, t / per) for n, t in report["top"]]}


def _median_time(step, state, *, warmup, budget_s, min_reps=3, max_reps=20, target_s=5e-3, profile=False):
    """step(state) -> (out, state), traceable. (median seconds per step, state, None or with
    `profile` `_device_profile`'s report).

    Each timed call runs the step `inner` times in ONE jitted fori_loop (the output and state
    threaded through, so nothing is hoisted), with `inner` chosen so a call lasts ~target_s:
    a short kernel is not charged the host's launch and sync (~0.1 ms per call on a GPU)."""
    once = jax.jit(step)
    out, state = once(state)  # compile
    jax.block_until_ready((out, state))
    t0 = time.perf_counter()
    out, state = once(state)
    jax.block_until_ready((out, state))
    inner = int(min(100, max(1, target_s // max(time.perf_counter() - t0, 1e-6))))

    def loop(carry):
        return jax.lax.fori_loop(0, inner, lambda i, c: step(c[1]), carry)

    looped = jax.jit(loop, donate_argnums=0)
    carry = (out, state)
    for _ in range(max(1, warmup)):
        carry = jax.block_until_ready(looped(carry))
    times = []
    while len(times) < min_reps or (len(times) < max_reps and sum(times) < budget_s):
        t0 = time.perf_counter()
        carry = jax.block_until_ready(looped(carry))
        times.append((time.perf_counter() - t0) / inner)
    report = None
    if profile:
        carry, report = _device_profile(looped, carry, inner)
    return statistics.median(times), carry[1], report


def _ours(model, smoke, config=None, kernel="gpu"):
    if kernel == "tpu":
        f = functools.partial(
            tpu.ragged_paged_attention_tpu,
            sm_scale=model.head_dim**-0.5,
            config=config,
            interpret=pltpu.InterpretParams() if smoke else None,
        )
    else:
        f = functools.partial(
            gpu.ragged_paged_attention_gpu, sm_scale=model.head_dim**-0.5, config=config, interpret=smoke
        )
    return jax.jit(f, donate_argnums=(3,))


def _one_call_config(batch: Batch, model: Model) -> tpu.TpuConfig:
    """The TPU kernel's single ragged call over the whole batch, as before the path split."""
    q, _, _, cache, _, page_indices, _, _ = batch.args
    return tpu_blocks.default_config(
        q.shape[0],
        page_indices.shape[0],
        model.q_heads // model.kv_heads,
        model.kv_heads,
        model.page_size,
        page_indices.shape[1],
        model.head_dim,
        model.dtype,
        cache.dtype,
    )


def _reference(model):
    f = functools.partial(ragged_paged_attention_reference, sm_scale=model.head_dim**-0.5)
    return jax.jit(f, donate_argnums=(3,))


def _jax_paged_inputs(batch: Batch, cache_after, ppcb=8, k_splits=16):
    """jax's layout: k/v_pages [Hkv, P, page, D], tables padded to k_splits * ppcb pages."""
    k_pages = jnp.transpose(cache_after[:, :, 0::2], (2, 0, 1, 3))
    v_pages = jnp.transpose(cache_after[:, :, 1::2], (2, 0, 1, 3))
    table = np.asarray(batch.args[5])
    ppcb = min(ppcb, table.shape[1])
    k_splits = max(1, min(k_splits, table.shape[1] // ppcb))
    width = -(-table.shape[1] // (k_splits * ppcb)) * k_splits * ppcb
    table = np.pad(table, ((0, 0), (0, width - table.shape[1])))
    return k_pages, v_pages, jnp.asarray(table), batch.args[4], ppcb, k_splits


def _jax_paged_fn(model, smoke, ppcb, k_splits):
    return jax.jit(
        functools.partial(jax_paged.paged_attention, pages_per_compute_block=ppcb, k_splits=k_splits, interpret=smoke)
    )


def _error(e):
    return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def _row_with_cache(name, fn, batch, want, tol, args):
    """Correctness once on a copy of the cache, then timing with the cache donated and threaded."""
    row = dict(impl=name)
    try:
        a = list(batch.args)
        a[3] = jnp.array(a[3], copy=True)
        out, _ = fn(*a)
        err = float(np.abs(np.asarray(out, np.float32) - want).max())
        row["err"] = err if err <= tol else f"FAIL {err:.3g}"

        def step(state):  # q, k and v threaded, not captured: XLA spent ~100 s of a GPU lease
            cache, qkv = state  # constant-folding the reference's dots of captured 4k-token chunks
            out, cache = fn(*qkv, cache, *a[4:])
            return out, (cache, qkv)

        row["t"], _, row["profile"] = _median_time(
            step,
            (jnp.array(batch.args[3], copy=True), tuple(a[:3])),
            warmup=args.warmup,
            budget_s=args.budget,
            profile=args.profile,
        )
    except Exception as e:  # noqa: BLE001 - report it in the table and keep going
        row["error"] = _error(e)
    return row


def _row_jax_paged(batch, cache_after, model, want, tol, args):
    row = dict(impl="jax ops.gpu.paged_attention")
    try:
        k_pages, v_pages, table, lengths, ppcb, k_splits = _jax_paged_inputs(batch, cache_after)
        fn = _jax_paged_fn(model, args.smoke, ppcb, k_splits)
        q = (batch.args[0] * model.head_dim**-0.5).astype(model.dtype)  # it has no sm_scale
        out = fn(q, k_pages, v_pages, table, lengths)
        err = float(np.abs(np.asarray(out, np.float32) - want).max())
        row["err"] = err if err <= tol else f"FAIL {err:.3g}"

        def step(state):  # q depends on the last output, so the loop cannot hoist the call
            prev, k_pages, v_pages = state  # threaded, not captured: no GB-sized constants
            out = fn(q + (prev[:1, :1, :1] * 0).astype(q.dtype), k_pages, v_pages, table, lengths)
            return out, (out, k_pages, v_pages)

        row["t"], _, row["profile"] = _median_time(
            step, (out, k_pages, v_pages), warmup=args.warmup, budget_s=args.budget, profile=args.profile
        )
    except Exception as e:  # noqa: BLE001
        row["error"] = _error(e)
    return row


def _row_jax_rpa(batch, cache_after, model, want, tol, args):
    """jax's TPU kernel over the written cache (it has no KV write)."""
    row = dict(impl="jax ops.tpu.ragged_paged_attention")
    try:
        q, _, _, _, kv_lens, page_indices, cu_q_lens, num_seqs = batch.args
        fn = jax.jit(functools.partial(jax_rpa.ragged_paged_attention, sm_scale=model.head_dim**-0.5))
        with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()) if args.smoke else contextlib.nullcontext():
            out = fn(q, cache_after, kv_lens, page_indices, cu_q_lens, num_seqs)
            err = float(np.abs(np.asarray(out, np.float32) - want).max())
            row["err"] = err if err <= tol else f"FAIL {err:.3g}"

            def step(state):  # q depends on the last output, so the loop cannot hoist the call
                prev, cache = state  # threaded, not captured: no GB-sized constant
                out = fn(q + (prev[:1, :1, :1] * 0).astype(q.dtype), cache, kv_lens, page_indices, cu_q_lens, num_seqs)
                return out, (out, cache)

            row["t"], _, row["profile"] = _median_time(
                step, (out, cache_after), warmup=args.warmup, budget_s=args.budget, profile=args.profile
            )
    except Exception as e:  # noqa: BLE001
        row["error"] = _error(e)
    return row


def _tpu_rows(batch: Batch, cache_after, model: Model, want, tol, args) -> list[dict]:
    rows = []
    if jax_rpa is not None and not args.skip_jax:
        rows.append(_row_jax_rpa(batch, cache_after, model, want, tol, args))
    del cache_after
    rows.insert(0, _row_with_cache("pallas_tpu", _ours(model, args.smoke, kernel="tpu"), batch, want, tol, args))
    one_call = _ours(model, args.smoke, _one_call_config(batch, model), "tpu")
    rows.insert(1, _row_with_cache("pallas_tpu one call", one_call, batch, want, tol, args))
    if not args.skip_reference:
        rows.insert(2, _row_with_cache("reference (XLA)", _reference(model), batch, want, tol, args))
    return rows


def run_batch(batch: Batch, model: Model, args) -> list[dict]:
    want, cache_after = jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=model.head_dim**-0.5))(
        *batch.args
    )
    want = np.asarray(want, np.float32)
    tol = 2e-5 if model.dtype == jnp.float32 else 5e-2
    if args.kernel == "tpu":
        return _tpu_rows(batch, cache_after, model, want, tol, args)
    jax_rows = []
    if batch.decode and jax_paged is not None and not args.skip_jax:
        jax_rows.append(_row_jax_paged(batch, cache_after, model, want, tol, args))
    del cache_after  # keep at most the batch's cache and one working copy alive from here on
    rows = [_row_with_cache("pallas_gpu", _ours(model, args.smoke), batch, want, tol, args)]
    if isinstance(paths := _gpu_paths(batch, model), gpu.GpuPaths):  # as before the decode split
        one_call = _ours(model, args.smoke, paths.rest)
        rows.append(_row_with_cache("pallas_gpu one call", one_call, batch, want, tol, args))
    if not args.skip_reference:
        rows.append(_row_with_cache("reference (XLA)", _reference(model), batch, want, tol, args))
    rows += jax_rows
    if args.sweep:  # --smoke exercises the sweep's code on its first two configs
        for config in sweep_configs(batch, model)[: 2 if args.smoke else None]:
            row = _row_with_cache(
                f"pallas_gpu {_config_name(config)}", _ours(model, args.smoke, config), batch, want, tol, args
            )
            rows.append({**row, "config": config})
    return rows


def tuned_entry(batch: Batch, model: Model, rows: list[dict], device_kind: str) -> dict | None:
    """A tuned-table entry (pallas_kernels/gpu_tuned.py) if a swept config beat the default."""
    default = next((r for r in rows if r["impl"] == "pallas_gpu" and "t" in r), None)
    swept = [r for r in rows if "config" in r and "t" in r and not str(r.get("err", "")).startswith("FAIL")]
    if default is None or not swept:
        return None
    best = min(swept, key=lambda r: r["t"])
    if best["t"] >= default["t"]:
        return None
    config = best["config"].rest if isinstance(best["config"], gpu.GpuPaths) else best["config"]
    q, page_indices = batch.args[0], batch.args[5]
    decode_like = gpu_config.is_decode_like(q.shape[0], page_indices.shape[0])
    return {
        "device": device_kind,
        "head_dim": model.head_dim,
        "group": model.q_heads // model.kv_heads,
        "page_size": model.page_size,
        "dtype": jnp.dtype(model.dtype).name,
        "mode": "decode" if decode_like else "prefill",
        "num_seqs": int(page_indices.shape[0]),
        "max_kv": int(page_indices.shape[1]) * model.page_size,
        "config": dataclasses.asdict(config),
        "ms": round(best["t"] * 1e3, 5),
        "default_ms": round(default["t"] * 1e3, 5),
        "measured": f"jax {jax.__version__}",
    }


def _config_name(c: gpu.GpuConfig | gpu.GpuPaths) -> str:
    if isinstance(c, gpu.GpuPaths):  # a sweep varies the call of the batch's other sequences
        return f"rest {_config_name(c.rest)}"
    return f"bq={c.block_q} bkv={c.block_kv} C={c.num_splits} w={c.num_warps} st={c.num_stages}"


def _gpu_paths(batch: Batch, model: Model) -> gpu.GpuConfig | gpu.GpuPaths:
    """What the GPU kernel runs by default on this batch (one config, or the decode split)."""
    q, page_indices = batch.args[0], batch.args[5]
    return gpu_config.default_paths(
        q.shape[0],
        page_indices.shape[0],
        model.q_heads // model.kv_heads,
        model.kv_heads,
        model.head_dim,
        model.page_size,
        page_indices.shape[1],
        model.dtype,
    )


def sweep_configs(batch: Batch, model: Model) -> list[gpu.GpuConfig | gpu.GpuPaths]:
    """The default config's neighbours, one field changed at a time (a coordinate search, so a
    sweep costs ~10 compiles per scenario rather than a full grid); for decode, also a ladder of
    KV splits at 4 and 8 warps, the knob that sets how many programs share the device. Under
    the decode split the neighbours are the other sequences' call's, beside the default decode
    call."""
    paths = _gpu_paths(batch, model)
    base = paths.rest if isinstance(paths, gpu.GpuPaths) else paths
    gp = common.next_pow2(model.q_heads // model.kv_heads)
    variants = [
        dict(block_kv=base.block_kv // 2),
        dict(block_kv=base.block_kv * 2),
        dict(block_q=base.block_q // 2),
        dict(block_q=base.block_q * 2),
        dict(num_splits=max(1, base.num_splits // 4)),
        dict(num_splits=base.num_splits * 2),
        dict(num_warps=4 if base.num_warps == 8 else 8),
        dict(num_stages=1),
        dict(num_stages=3),
    ]
    if batch.decode:  # and two pipeline stages, which keep the next block's gather in flight
        variants += [dict(num_splits=c, num_warps=w) for w in (4, 8) for c in (1, 2, 4, 8, 16)]
        variants += [dict(num_splits=c, num_stages=2) for c in (1, 4, 8)]
    out = []
    for change in variants:
        config = dataclasses.replace(base, **change)
        if (
            config != base
            and config not in out
            and config.block_kv >= 16
            and config.block_q * gp >= 16
            and config.block_q >= 1
        ):
            out.append(config)
    if isinstance(paths, gpu.GpuPaths):
        return [dataclasses.replace(paths, rest=c) for c in out]
    return out


def measure_ceilings(smoke):
    """(copy bytes/s, bf16 matmul FLOP/s), each many operations inside one timed call."""
    if smoke:
        return ceilings.copy_rate(1 << 20, 2), ceilings.matmul_rate(256, 2)
    return ceilings.copy_rate(1 << 29, 20), ceilings.matmul_rate(8192, 10)


def scenarios(args):
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    if args.smoke:
        batches, contexts, chunks = [3], [40, 100], [48]
        mixed = dict(chunk=48, prefix=16, decode_seqs=3, ctx=70)
    else:
        batches = ints(args.batches)
        contexts = ints(args.contexts)
        chunks = ints(args.chunks)
        mixed = dict(chunk=2048, prefix=2048, decode_seqs=64, ctx=4096)
    want = set(args.scenarios.split(","))
    if "decode" in want:
        for b in batches:
            for ctx in contexts:
                if b * ctx <= args.max_kv_tokens:
                    yield f"decode b={b} ctx={ctx}", [1] * b, [ctx] * b
    if "prefill" in want:
        for c in chunks:
            yield f"prefill chunk={c}", [c], [c]
    if "mixed" in want:
        m = mixed
        yield (
            f"mixed: 1 x {m['chunk']} chunk (+{m['prefix']} cached) + {m['decode_seqs']} decode @ {m['ctx']}",
            [m["chunk"]] + [1] * m["decode_seqs"],
            [m["chunk"] + m["prefix"]] + [m["ctx"]] * m["decode_seqs"],
        )


def print_profiles(profiles) -> None:
    """The second table of --profile: per row, its device-busy time and top kernels per call."""
    if not profiles:
        return
    print("\n| scenario | impl | device kernel | ms per call | share of busy |\n|---|---|---|---|---|")
    for name, impl, report in profiles:
        if isinstance(report, str):
            print(f"| {name} | {impl} | {report} | | |")
            continue
        busy = report["busy_s"]
        print(f"| {name} | {impl} | (device busy) | {busy * 1e3:.4g} | 100% |")
        for kernel, t in report["top"]:
            print(f"| {name} | {impl} | {kernel[:80]} | {t * 1e3:.4g} | {100 * t / busy:.0f}% |")


def _fmt(x, digits=3):
    return "" if x is None else f"{x:.{digits}g}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode, CPU ok")
    p.add_argument(
        "--kernel",
        choices=["gpu", "tpu"],
        default=None,
        help="whose Pallas kernel to time (default: the backend's; gpu on the CPU)",
    )
    p.add_argument("--scenarios", default="decode,prefill,mixed")
    p.add_argument("--batches", default="1,8,32,64,128,256")
    p.add_argument("--contexts", default="1024,4096,8192,16384,32768")
    p.add_argument("--chunks", default="512,1024,2048,4096,8192")
    p.add_argument(
        "--max-kv-tokens",
        type=int,
        default=1 << 21,
        help="skip decode rows with batch * context above this (memory, time)",
    )
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget", type=float, default=1.0, help="seconds of timed calls per row")
    p.add_argument("--skip-reference", action="store_true")
    p.add_argument("--skip-jax", action="store_true")
    p.add_argument(
        "--sweep", action="store_true", help="also time the default GpuConfig's neighbours (tuning default_config)"
    )
    p.add_argument(
        "--profile", action="store_true", help="also trace each row and list its top device kernels per call"
    )
    p.add_argument(
        "--write-table",
        nargs="?",
        const=str(gpu_tuned.TABLE),
        default=None,
        help="with --sweep: add each row's fastest config, where it beat the default, "
        "to the tuned table (default: the package's gpu_tuned.json)",
    )
    args = p.parse_args(argv)
    args.kernel = args.kernel or ("tpu" if jax.default_backend() == "tpu" else "gpu")
    if args.kernel == "tpu" and (args.sweep or args.write_table):
        sys.exit("--sweep and --write-table tune the GPU kernel's table")
    if args.smoke:  # head_dim 128 on the TPU rows: jax's TPU kernel takes multiples of 128
        model = Model(4, 2, 128 if args.kernel == "tpu" else 64, 16, jnp.float32)
        args.warmup, args.budget = 1, 0.0
    else:
        model = Model(args.q_heads, args.kv_heads, args.head_dim, args.page_size, jnp.dtype(args.dtype))

    if not args.smoke and jax.default_backend() != args.kernel:
        sys.exit(
            f"bench_attention --kernel {args.kernel} needs a {args.kernel.upper()} (backend is "
            f"{jax.default_backend()!r}); use --smoke to exercise it on the CPU"
        )
    device = jax.devices()[0]
    bandwidth, flops = measure_ceilings(args.smoke)
    print(f"# Ragged paged attention on {device.device_kind} (jax {jax.__version__})\n")
    print(
        f"Model: Hq={model.q_heads} Hkv={model.kv_heads} D={model.head_dim} "
        f"page={model.page_size} {jnp.dtype(model.dtype).name}"
        f"{' (smoke: interpret mode)' if args.smoke else ''}"
    )
    rated = ceilings.RATED.get(device.device_kind)
    rated = f" (rated {rated[0] / 1e12:.2f} TB/s, {rated[1] / 1e12:.0f} TFLOP/s)" if rated else ""
    print(
        f"Ceilings (measured in one call each): copy {bandwidth / 1e9:.1f} GB/s, bf16 matmul "
        f"{flops / 1e12:.1f} TFLOP/s{rated}; "
        f"jax's {args.kernel.upper()} kernel "
        f"{'available' if (jax_rpa if args.kernel == 'tpu' else jax_paged) else 'not importable'}\n"
    )
    print("| scenario | impl | median ms | GB/s | % BW | TFLOP/s | % FLOP/s | max err vs ref | note |")
    print("|---|---|---|---|---|---|---|---|---|")
    tuned, profiles = [], []
    for i, (name, q_lens, kv_lens) in enumerate(scenarios(args)):
        batch = make_batch(name, q_lens, kv_lens, model, seed=i)
        rows = run_batch(batch, model, args)
        if args.write_table and (entry := tuned_entry(batch, model, rows, device.device_kind)):
            tuned.append(entry)  # written at once: a run cut short by a time limit keeps it
            gpu_tuned.merge([entry], args.write_table)
        for row in rows:
            t = row.get("t")
            gbs = batch.kv_bytes / t / 1e9 if t else None
            tfs = batch.flops / t / 1e12 if t else None
            show_bw = batch.decode or name.startswith("mixed")
            print(
                f"| {name} | {row['impl']} | {_fmt(t and t * 1e3, 4)} "
                f"| {_fmt(gbs) if show_bw else ''} "
                f"| {_fmt(gbs and 100 * gbs * 1e9 / bandwidth, 3) if show_bw else ''} "
                f"| {'' if batch.decode else _fmt(tfs)} "
                f"| {'' if batch.decode else _fmt(tfs and 100 * tfs * 1e12 / flops, 3)} "
                f"| {row['err'] if isinstance(row.get('err'), str) else _fmt(row.get('err'), 2)} "
                f"| {row.get('error', '')} |",
                flush=True,
            )
            if row.get("profile"):
                profiles.append((name, row["impl"], row["profile"]))
        del batch
    print_profiles(profiles)
    if tuned:
        print(f"\n{len(tuned)} tuned entries written to {args.write_table}")


if __name__ == "__main__":
    main()
