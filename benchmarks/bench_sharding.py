"""Sharding overheads on the CPU: step time for tensor=1/2/4/8, stages, a split cache, KV layouts.

    .venv/bin/python benchmarks/bench_sharding.py [tensor|stage|kv-split|context|kv-layout|all] [--repeats N]

Runs on 8 forced host devices (XLA_FLAGS=--xla_force_host_platform_device_count=8, set here
before jax is imported). These are CPU figures: the "devices" share this machine's cores, so
tensor parallelism cannot speed anything up here; the table shows what splitting costs
(collectives, smaller matmuls, per-shard kernel calls), not a TPU/GPU scaling curve.

  tensor:    one jitted engine step (CompiledStep.execute: forward + KV write + sampling) of a
             fixed random Llama-like model (MODEL, ~27M parameters, float32), decode (8 sequences
             x 1 token, 256 tokens of context each) and prefill (one 256-token chunk), for
             tensor = 1, 2, 4, 8.
  stage:     engine decode throughput at batch 16, stage=2 (a batch in flight on each stage, and
             one batch at a time) against tensor=2 (2 devices) and one device.
  kv-split:  decode (4 x 1 token) at 1024, 4096 and 16384 tokens of context, one device against
             sequence=4 (each device a quarter of every page's rows).
  context:   causal attention over one sequence split over sequence=4: ring (ppermute) vs
             all-gather of K/V (sharding/context_parallel.py), for several lengths.
  kv-layout: with fewer KV heads than tensor shards (K=2, tensor=4), attention over the paged
             cache with KV heads repeated to one per shard (what the engine does) vs a cache
             replicated on every shard that each shard slices.
Timings are medians over --repeats runs after a warm-up call (the methods being compared are
interleaved, so a busy machine slows them alike). Prints markdown tables.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import functools  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

from jaxinfer.config import EngineConfig, ModelConfig  # noqa: E402
from jaxinfer.engine import Engine  # noqa: E402
from jaxinfer.loader import LoadedModel  # noqa: E402
from jaxinfer.models.layers import AttentionMetadata  # noqa: E402
from jaxinfer.models.registry import get_family  # noqa: E402
from jaxinfer.sampling import SamplingParams  # noqa: E402
from jaxinfer.sampling.arrays import make_sampling_arrays  # noqa: E402
from jaxinfer.worker.inputs import StepInputs  # noqa: E402
from jaxinfer.worker.page_table import padded_updates  # noqa: E402
from jaxinfer.worker.worker import Worker  # noqa: E402
from pallas_kernels import ragged_paged_attention  # noqa: E402
from pallas_kernels.kv_write import write_kv  # noqa: E402
from sharding import make_mesh  # noqa: E402
from sharding.context_parallel import context_parallel_attention  # noqa: E402

# ~27M parameters: 16 heads of 32 (tensor=8 splits them 2 per shard), 4 KV heads (repeated to
# one per shard at tensor=8), vocab 16000.
MODEL = ModelConfig(
    model_type="llama",
    family="llama",
    vocab_size=16000,
    hidden_size=512,
    intermediate_size=1408,
    num_layers=4,
    num_heads=16,
    num_kv_heads=4,
    head_dim=32,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=1024,
)
PREFILL = 256
PAGE = 16
DECODE = 32  # bench_stage's decode tokens per request


def timed(fn, repeats: int) -> list[float]:
    jax.block_until_ready(fn())  # warm-up (compiles)
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - start)
    return out


def step_inputs(runner: Worker, lens: list[int], new: list[int], t_bucket: int) -> StepInputs:
    """A step over sequences with kv_len lens[i], the last new[i] tokens of each computed now."""
    s_bucket = runner.step.engine.seq_bucket(t_bucket)
    pages = np.zeros((s_bucket, runner.state.pages_per_seq), np.int32)
    cu = np.zeros(s_bucket + 1, np.int32)
    kv_lens = np.zeros(s_bucket, np.int32)
    positions = np.zeros(t_bucket, np.int32)
    next_page, offset = 1, 0
    for i, (length, n) in enumerate(zip(lens, new)):
        count = -(-length // PAGE)
        pages[i, :count] = np.arange(next_page, next_page + count)
        next_page += count
        positions[offset : offset + n] = np.arange(length - n, length)
        offset += n
        kv_lens[i], cu[i + 1] = length, offset
    cu[len(lens) + 1 :] = offset
    rng = np.random.default_rng(0)
    sampling = make_sampling_arrays(
        [SamplingParams(temperature=0)] * len(lens), [0] * len(lens), batch_size=s_bucket, seeds=list(range(len(lens)))
    )
    meta = AttentionMetadata(kv_lens, None, cu, np.array([len(lens)], np.int32))
    tokens = rng.integers(0, MODEL.vocab_size, t_bucket).astype(np.int32)
    rows, cols = np.nonzero(pages)  # sequence i's block table in the device table's row i + 1
    table = padded_updates([(rows + 1, cols, pages[rows, cols], np.zeros_like(rows))], runner.step.inputs.update_widths)
    slots = np.where(np.arange(s_bucket) < len(lens), np.arange(1, s_bucket + 1), 0).astype(np.int32)
    return StepInputs(
        tokens,
        positions,
        meta,
        np.maximum(cu[1:] - 1, 0),
        sampling,
        np.full(t_bucket, -1, np.int32),
        slots,
        table=table,
    )


def random_model() -> LoadedModel:
    """MODEL with random weights (seed 0)."""
    family = get_family("llama")
    return LoadedModel(MODEL, family.init_params(MODEL, jax.random.key(0)), None, family, Path("random"))


def worker_on(model: LoadedModel, mesh: str | None, max_model_len: int = 1024, **options) -> Worker:
    """A worker of the benchmark model on `mesh` ("tensor=1" and None: one device), pages of
    PAGE tokens, no penalty history, no compilation cache; `options`: the rest of its config."""
    engine = EngineConfig(
        page_size=PAGE,
        max_model_len=max_model_len,
        penalties=False,
        compilation_cache_dir=None,
        mesh=None if mesh in (None, "tensor=1", "none") else mesh,
        **options,
    )
    return Worker(model, engine, max_model_len)


def bench_tensor(repeats: int) -> str:
    model = random_model()
    rows = [
        f"| mesh | decode step, 8 seqs x 1 token (ms) | prefill step, {PREFILL} tokens (ms) | "
        "params per device (MiB) |",
        "|---|---|---|---|",
    ]
    for tp in (1, 2, 4, 8):
        runner = worker_on(
            model,
            f"tensor={tp}",
            num_pages=160,
            max_num_batched_tokens=PREFILL,
            max_num_seqs=8,
            token_buckets=(8, PREFILL),
        )
        decode = step_inputs(runner, [256] * 8, [1] * 8, 8)
        prefill = step_inputs(runner, [PREFILL], [PREFILL], PREFILL)
        t_decode, t_prefill = [], []
        for _ in range(repeats):  # interleave decode and prefill
            t_decode += timed(lambda runner=runner, decode=decode: runner.step.execute(decode), 1)
            t_prefill += timed(lambda runner=runner, prefill=prefill: runner.step.execute(prefill), 1)
        shard_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(runner.state.params))
        rows.append(
            f"| tensor={tp} | {1e3 * statistics.median(t_decode):.1f} | "
            f"{1e3 * statistics.median(t_prefill):.1f} | {shard_bytes / 2**20:.1f} |"
        )
        print(rows[-1], file=sys.stderr, flush=True)
        del runner
    return "\n".join(rows)


def bench_stage(repeats: int) -> str:
    """Engine decode throughput at batch 16 on 2 devices: tensor=2 against stage=2 with a batch
    in flight on each stage (worker/pipelined.py) and with one batch through the stages at a
    time (pipeline_batches=False), and one device. Each run: 16 requests of 64-token prompts,
    greedy, twice: 1 token (prefill) and 1 + DECODE tokens; decode tokens/s is 16 * DECODE over
    the difference; an engine step's decode time likewise (with stages in flight a step is a
    tick: every stage on its own batch of 8). Token buckets 8, 16, 256: a replica's batch of 8
    sequences is not padded to 16. Also the share of ticks' stages that had a batch."""
    model = random_model()
    prompts = [np.random.default_rng(i).integers(1, MODEL.vocab_size, 64).tolist() for i in range(16)]
    cases = {
        "tensor=2": ("tensor=2", {}),
        "stage=2": ("stage=2", {}),
        "stage=2, one batch at a time": ("stage=2", {"pipeline_batches": False}),
        "tensor=1": ("tensor=1", {}),
    }
    engines = {}
    for name, (mesh, extra) in cases.items():
        options = dict(
            page_size=PAGE, max_model_len=1024, penalties=False, compilation_cache_dir=None, enable_prefix_caching=False
        )
        options.update(
            num_pages=320, max_num_batched_tokens=PREFILL, max_num_seqs=16, token_buckets=(16, PREFILL), **extra
        )
        engines[name] = Engine(model, EngineConfig(**options, mesh=None if mesh == "tensor=1" else mesh))

    def run(engine: Engine, max_tokens: int) -> tuple[float, int]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, params, request_id=f"{max_tokens}-{i}")
        steps, start = 0, time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            steps += 1
        return time.perf_counter() - start, steps

    for engine in engines.values():
        run(engine, 2)  # warm-up: every variant the runs use has run once
    decode: dict[str, list[float]] = {name: [] for name in engines}
    per_step: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats):  # interleaved, so a busy machine slows them alike
        for name, engine in engines.items():
            (first, first_steps), (whole, steps) = run(engine, 1), run(engine, 1 + DECODE)
            decode[name].append(16 * DECODE / (whole - first))
            per_step[name].append((whole - first) / (steps - first_steps))
    base = statistics.median(decode["tensor=2"])
    rows = [
        f"| mesh | decode tokens/s (16 seqs, {DECODE} tokens) | vs tensor=2 | decode engine step (ms) "
        "| stages with a batch |",
        "|---|---|---|---|---|",
    ]
    for name, engine in engines.items():
        tps = statistics.median(decode[name])
        full = engine.stats().get("pipeline_occupancy")
        occupancy = "-" if full is None else f"{full:.2f}"
        rows.append(
            f"| {name} | {tps:.0f} | {tps / base:.2f}x | {1e3 * statistics.median(per_step[name]):.1f} | {occupancy} |"
        )
    return "\n".join(rows)


def bench_kv_split(repeats: int) -> str:
    """Decode (4 sequences x 1 token) at three context lengths on one device against sequence=4,
    whose devices each hold a quarter of every page's rows and attend over them."""
    model = random_model()
    lengths = (1024, 4096, 16384)
    runners = {}
    for mesh in ("none", "sequence=4"):
        runner = worker_on(
            model,
            mesh,
            lengths[-1] + 16,
            num_pages=4 * lengths[-1] // PAGE + 8,
            max_num_batched_tokens=8,
            max_num_seqs=8,
            token_buckets=(8,),
        )
        runners[mesh] = (runner, {n: step_inputs(runner, [n] * 4, [1] * 4, 8) for n in lengths})
    times = {(m, n): [] for m in runners for n in lengths}
    for _ in range(repeats):
        for n in lengths:
            for m, (runner, inputs) in runners.items():
                times[m, n].extend(timed(lambda runner=runner, x=inputs[n]: runner.step.execute(x), 1))
    rows = [
        "| context | one device (ms) | sequence=4 (ms) | sequence=4 / one device | "
        "cache per device, one device / sequence=4 (MiB) |",
        "|---|---|---|---|---|",
    ]
    cache = {m: sum(c.addressable_shards[0].data.nbytes for c in r.state.kv_caches) for m, (r, _) in runners.items()}
    for n in lengths:
        one, split = statistics.median(times["none", n]), statistics.median(times["sequence=4", n])
        rows.append(
            f"| {n} | {1e3 * one:.1f} | {1e3 * split:.1f} | {split / one:.2f} | "
            f"{cache['none'] / 2**20:.0f} / {cache['sequence=4'] / 2**20:.0f} |"
        )
    return "\n".join(rows)


def bench_context(repeats: int) -> str:
    mesh = make_mesh("sequence=4")
    rows = ["| tokens | all-gather K/V (ms) | ring, ppermute (ms) |", "|---|---|---|"]
    for length in (1024, 2048, 4096):
        ks = jax.random.split(jax.random.key(length), 3)
        q = jax.random.normal(ks[0], (length, 8, 64))
        k, v = (jax.random.normal(key, (length, 2, 64)) for key in ks[1:])
        fns = {
            m: jax.jit(functools.partial(context_parallel_attention, mesh=mesh, method=m))
            for m in ("allgather", "ring")
        }
        times = {m: [] for m in fns}
        for _ in range(repeats):
            for m, fn in fns.items():
                times[m] += timed(lambda: fn(q, k, v), 1)
        rows.append(
            f"| {length} | {1e3 * statistics.median(times['allgather']):.1f} | "
            f"{1e3 * statistics.median(times['ring']):.1f} |"
        )
        print(rows[-1], file=sys.stderr, flush=True)
    return "\n".join(rows)


def _kv_layout_fns(mesh, heads: int, kv_heads: int, tp: int):
    """Attention per shard with (a) KV heads repeated to one per shard, (b) a replicated cache."""
    attend = functools.partial(ragged_paged_attention, sm_scale=0.125, impl="reference")
    meta_specs = (P(), P(), P(), P())
    repeat = tp // kv_heads

    def repeated(q, k, v, cache, *meta):
        return attend(q, k, v, cache, *meta)

    def replicated(q, k, v, cache, *meta):
        # Every shard writes all K heads into its copy, then attends with the head it needs.
        head = jax.lax.axis_index("tensor") // repeat
        cache = write_kv(cache, k, v, *meta)
        kv = jax.lax.dynamic_slice_in_dim(cache, 2 * head, 2, axis=2)
        kh = jax.lax.dynamic_slice_in_dim(k, head, 1, axis=1)
        vh = jax.lax.dynamic_slice_in_dim(v, head, 1, axis=1)
        out, _ = attend(q, kh, vh, kv, *meta)
        return out, cache

    tok = P(None, "tensor", None)
    a = jax.shard_map(
        repeated,
        mesh=mesh,
        in_specs=(tok, tok, tok, P(None, None, "tensor", None), *meta_specs),
        out_specs=(tok, P(None, None, "tensor", None)),
        check_vma=False,
    )
    b = jax.shard_map(
        replicated, mesh=mesh, in_specs=(tok, P(), P(), P(), *meta_specs), out_specs=(tok, P()), check_vma=False
    )
    return jax.jit(a, donate_argnums=(3,)), jax.jit(b, donate_argnums=(3,))


def bench_kv_layout(repeats: int) -> str:
    tp, heads, kv_heads, d, seqs, ctx = 4, 8, 2, 64, 8, 1024
    mesh = make_mesh(f"tensor={tp}")
    fn_rep, fn_full = _kv_layout_fns(mesh, heads, kv_heads, tp)
    num_pages = seqs * ctx // PAGE + 1
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((seqs, heads, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((seqs, kv_heads, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((seqs, kv_heads, d)), jnp.float32)
    pages = np.arange(1, num_pages).reshape(seqs, ctx // PAGE).astype(np.int32)
    meta = (np.full(seqs, ctx, np.int32), pages, np.arange(seqs + 1, dtype=np.int32), np.array([seqs], np.int32))
    r = tp // kv_heads
    caches = {
        "repeated": jax.device_put(
            jnp.zeros((num_pages, PAGE, 2 * tp, d)), NamedSharding(mesh, P(None, None, "tensor", None))
        ),
        "replicated": jax.device_put(jnp.zeros((num_pages, PAGE, 2 * kv_heads, d)), NamedSharding(mesh, P())),
    }
    args = {"repeated": (jnp.repeat(k, r, axis=1), jnp.repeat(v, r, axis=1)), "replicated": (k, v)}
    fns = {"repeated": fn_rep, "replicated": fn_full}
    times = {m: [] for m in fns}

    def run(m):
        out, caches[m] = fns[m](q, *args[m], caches[m], *meta)
        return out

    for _ in range(repeats):
        for m in fns:
            times[m] += timed(lambda: run(m), 1)
    rows = [
        f"| KV layout (K={kv_heads}, tensor={tp}, {seqs} seqs x {ctx} tokens) | attention call (ms) | "
        f"cache per device per layer (MiB) |",
        "|---|---|---|",
    ]
    for m in fns:
        per_device = caches[m].addressable_shards[0].data.nbytes / 2**20
        rows.append(f"| {m} | {1e3 * statistics.median(times[m]):.2f} | {per_device:.1f} |")
        print(rows[-1], file=sys.stderr, flush=True)
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "what", nargs="?", default="all", choices=["tensor", "stage", "kv-split", "context", "kv-layout", "all"]
    )
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.default_backend()} devices, {os.cpu_count()} host cores")
    if args.what in ("tensor", "all"):
        print(bench_tensor(args.repeats) + "\n")
    if args.what in ("stage", "all"):
        print(bench_stage(args.repeats) + "\n")
    if args.what in ("kv-split", "all"):
        print(bench_kv_split(args.repeats) + "\n")
    if args.what in ("context", "all"):
        print(bench_context(args.repeats) + "\n")
    if args.what in ("kv-layout", "all"):
        print(bench_kv_layout(args.repeats) + "\n")


if __name__ == "__main__":
    main()
