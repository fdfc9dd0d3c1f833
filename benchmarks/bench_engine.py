"""Engine throughput and latency on the default model, beside HF transformers in the same run.

    .venv/bin/python benchmarks/bench_engine.py [--hf-python /path/to/python-with-torch]
    python benchmarks/bench_engine.py --shape llama-3.2-1b|llama-3.1-8b|qwen3-30b-a3b|gemma-3-1b|smollm2 [--startup]

--shape: random weights of that model's real shape built on the device (benchmarks/shapes.py; no
download, no transformers; with --hf-python, HF transformers builds them and runs beside the
engine on the same weights; add --llamacpp-python for llama.cpp at batch 1 on a float32 GGUF of
them, benchmarks/llamacpp_peer.py), bfloat16 on accelerators. Reports decode tokens/s at each batch and
prompt length and a 2048-token prefill, each beside its floor (weight + KV bytes over the measured
copy rate; FLOPs over the measured matmul rate; benchmarks/ceilings.py), and with --startup the
engine's cold (empty compilation cache) and warm start-up; with --profile, the fraction of
each decode step the device sits idle (from a jax.profiler trace) and its costliest kernels (on
the CPU: XLA's operations by kind, and the time no XLA thread runs one).

Measures (medians over repeats, after warm-up; nothing may compile during the timed part):
  prefill tokens/s for a 256-token prompt (from time to first token with max_tokens=1),
  decode tokens/s at batch 1, 8, 32 (batch / median inter-token latency),
  TTFT and inter-token latency percentiles under Poisson arrivals (benchmarks/workload.py;
  HF serves the same stream one request at a time, as generate has no continuous batching).
The HF side runs benchmarks/hf_baseline.py under --hf-python (a Python with torch and
transformers), so torch never enters this project's environment. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from jaxinfer.llm import LLM
from jaxinfer.loader import default_model_path
from jaxinfer.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
import profile_idle  # noqa: E402
from workload import make_workload, steady_itl, summarize  # noqa: E402


def bench_prefill(llm, prompt_len, repeats):
    rng = np.random.default_rng(0)
    rates = []
    for _ in range(repeats):
        prompt = rng.integers(100, 40000, prompt_len).tolist()
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
        rates.append(prompt_len / out.metrics.time_to_first_token)
    return statistics.median(rates)


def bench_decode(llm, batch, new_tokens):
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(100, 40000, 16).tolist() for _ in range(batch)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
    # Requests advance together, one token each per step: steady-state ITL after the first token.
    itl = statistics.median(x for o in outs for x in o.metrics.inter_token_latencies[2:])
    return batch / itl


def bench_stream(llm, rate, num_requests, seed=0):
    """Poisson arrivals of the shared workload; continuous batching serves them together."""
    workload = make_workload(rate, num_requests, seed)
    engine = llm.engine
    start = time.monotonic()
    pending = list(range(num_requests))
    done = {}
    while pending or engine.has_unfinished():
        now = time.monotonic() - start
        while pending and workload[pending[0]][0] <= now:
            i = pending.pop(0)
            arrival, prompt, max_tokens = workload[i]
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            engine.add_request(prompt, params, request_id=f"s{i}", arrival_time=start + arrival)
        if not engine.has_unfinished():
            time.sleep(max(0.0, workload[pending[0]][0] - (time.monotonic() - start)))
            continue
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    elapsed = time.monotonic() - start
    ttft = [o.metrics.time_to_first_token for o in done.values()]
    itl = [x for o in done.values() for x in o.metrics.inter_token_latencies]
    tokens = sum(o.usage.completion_tokens for o in done.values())
    return summarize(ttft, itl, num_requests, tokens, elapsed, rate)


def run_hf(python, batches, rates, num_requests):
    if not python:
        return None
    cmd = [
        python,
        str(Path(__file__).with_name("hf_baseline.py")),
        str(default_model_path()),
        "--batches",
        *map(str, batches),
        "--stream-rates",
        *map(str, rates),
        "--stream-requests",
        str(num_requests),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_engine_decode(engine, batch, prompt_len, new_tokens, seed=0):
    """Median steady-state inter-token latency of `batch` greedy requests decoding together."""
    rng = np.random.default_rng(seed)
    vocab = engine.model.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    ids = [engine.add_request(rng.integers(1, vocab, prompt_len).tolist(), params) for _ in range(batch)]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return steady_itl([done[rid].metrics for rid in ids])


def run_engine_prefill(engine, prompt_len, seed=1):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, engine.model.config.vocab_size, prompt_len).tolist()
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                ttft = out.metrics.time_to_first_token
    return ttft


def bench_shape(args):
    import ceilings
    from llamacpp_peer import run_peer
    from shapes import decode_floor_s, param_bytes, prefill_floor_s, random_model

    from jaxinfer.config import EngineConfig
    from jaxinfer.engine import Engine

    cpu = jax.default_backend() == "cpu"
    batches = args.batches if args.batches != [1, 8, 32] or cpu else [1, 16, 64, 256]
    ceil = ceilings.describe()
    hf, weights = run_hf_shape(args, batches) if args.hf_python else (None, None)
    if weights is not None:  # the weights HF made and saved: both sides run the same model
        from jaxinfer.loader import load_model

        model = load_model(weights, args.dtype, with_tokenizer=False)
        peer = args.llamacpp_python and run_peer(
            args.llamacpp_python, weights, args.prompt_lens[0], args.new_tokens, args.repeats
        )
        shutil.rmtree(weights.parent, ignore_errors=True)  # 16 GB for the 8B shape
    else:
        peer = None
        model = random_model(args.shape, args.dtype, quantization=args.quantization, num_layers=args.layers)
        jax.block_until_ready(model.params)
        print(f"[{time.strftime('%H:%M:%S')}] random weights ready", file=sys.stderr, flush=True)
    budget = max(args.prefill_len, max(batches))
    config = EngineConfig(
        max_num_seqs=max(batches),
        max_num_batched_tokens=budget,
        max_model_len=max(4096, args.prefill_len + 1, max(args.prompt_lens) + args.new_tokens),
        penalties=False,
        compilation_cache_dir=args.cache_dir,
        async_scheduling=not args.no_async_scheduling,
        num_decode_steps=args.num_decode_steps,
        greedy_variant={"on": True, "off": False}.get(args.greedy_variant),
        dispatch_thread={"on": True, "off": False}.get(args.dispatch_thread),
        token_buckets=tuple(args.token_buckets) if args.token_buckets else None,
    )
    startup = {}
    if args.startup:  # an empty compilation cache, kept for the run (the main engine reads it back)
        cold_dir = tempfile.mkdtemp(prefix="jaxinfer-cold-")
        atexit.register(shutil.rmtree, cold_dir, ignore_errors=True)
        config = config.replace(compilation_cache_dir=cold_dir)
        for kind in ("cold", "warm"):
            start = time.perf_counter()
            engine = Engine(model, config)
            startup[kind] = time.perf_counter() - start
            del engine
    engine = Engine(model, config)
    variants = engine.worker.num_compiled()
    print(f"[{time.strftime('%H:%M:%S')}] engine ready ({variants} variants)", file=sys.stderr, flush=True)
    rows = []
    for prompt_len in args.prompt_lens:
        for b in batches:
            itl = run_engine_decode(engine, b, prompt_len, args.new_tokens)
            floor = decode_floor_s(model, b, prompt_len + args.new_tokens // 2, ceil["copy_bytes_per_s"])
            theirs = hf and prompt_len == args.prompt_lens[0] and hf["decode"].get(str(b))
            rows.append((f"decode, batch {b} x {prompt_len}-token prompt", b / itl, itl, floor, theirs))
            print(
                f"[{time.strftime('%H:%M:%S')}] {rows[-1][0]}: {1e3 * itl:.2f} ms per step", file=sys.stderr, flush=True
            )  # progress, for runs cut short by a time limit
    decode = lambda b, seed: run_engine_decode(engine, b, args.prompt_lens[0], args.new_tokens, seed)  # noqa: E731
    device = profile_idle.device_of(jax.default_backend())
    idle = (
        [(b, *profile_idle.traced(lambda: decode(b, 7), device), args.new_tokens) for b in args.profile_batches]
        if args.profile
        else []
    )
    for b in args.profile_batches if args.host_profile else ():
        itl, stats = profile_idle.host_profile(lambda: decode(b, 9))
        print(
            f"\n## Host profile, decode batch {b} ({args.new_tokens} steps, ITL {1e3 * itl:.2f} ms "
            f"under cProfile)\n```\n{stats}```"
        )
    ttft = run_engine_prefill(engine, args.prefill_len)
    rows.append(
        (
            f"prefill, one {args.prefill_len}-token prompt",
            args.prefill_len / ttft,
            ttft,
            prefill_floor_s(model, args.prefill_len, ceil["matmul_flops_per_s"]),
            hf and hf["prefill_tokens_per_s"],
        )
    )
    assert engine.worker.num_compiled() == variants, "a step compiled after warm-up"
    dtype = model.params.embed.dtype
    layers = f"{args.layers} of its layers, " if args.layers else ""
    print(
        f"Device: {ceil['device']}; jax {jax.__version__}; shape {args.shape} ({layers}{dtype}"
        f"{', weights ' + args.quantization if args.quantization else ''}, "
        f"{param_bytes(model) / 2**30:.2f} GiB of weights); async scheduling "
        f"{'off' if args.no_async_scheduling else 'on'}; decode windows of "
        f"{engine.worker.step.num_decode_steps} steps; greedy twin "
        f"{'on' if engine.worker.step.greedy_buckets else 'off'}; launcher thread "
        f"{'on' if engine.worker.step.launcher.enabled else 'off'}; {variants} variants"
    )
    rated = (
        f" (rated {ceil['rated_bytes_per_s'] / 1e12:.2f} TB/s, {ceil['rated_flops_per_s'] / 1e12:.0f} TFLOP/s)"
        if ceil["rated_bytes_per_s"]
        else ""
    )
    print(
        f"Measured ceilings: copy {ceil['copy_bytes_per_s'] / 1e9:.1f} GB/s, matmul "
        f"{ceil['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s{rated}"
    )
    if startup:
        print(f"Start-up: cold {startup['cold']:.1f} s, warm {startup['warm']:.1f} s")
    if hf:
        print(f"HF transformers {hf.get('transformers', '')} (torch {hf['torch']}) on the same weights")
    if peer:  # batch 1 at the first prompt length: rows[0]
        print(
            f"llama.cpp (llama-cpp-python {peer['llama_cpp']}, {peer['threads']} threads, float32 GGUF of the "
            f"same weights): batch-1 decode {peer['decode']['1']:.1f} tok/s; jaxinfer / llama.cpp "
            f"{rows[0][1] / peer['decode']['1']:.2f}x"
        )
    print(
        "\n| run | tok/s | time per step (ms) | floor (ms) | % of floor | HF tok/s | vs HF |"
        "\n|---|---|---|---|---|---|---|"
    )
    for name, rate, t, floor, theirs in rows:
        vs = f"| {theirs:.1f} | {rate / theirs:.2f}x |" if theirs else "| - | - |"
        print(f"| {name} | {rate:.1f} | {1e3 * t:.2f} | {1e3 * floor:.2f} | {100 * floor / t:.0f}% {vs}")
    if idle:
        print(
            "\n| profiled decode | ITL (ms) | device busy per step (ms) | device idle | kernels per step "
            "| D2H copies per step (idle after them, ms) | top kernels (ms per step) |"
            "\n|---|---|---|---|---|---|---|"
        )
    for b, itl, rep, steps in idle:
        print(profile_row(b, itl, rep, steps))
    return 0


def profile_row(batch: int, itl: float, rep: dict | None, steps: int) -> str:
    """A row of the profiled-decode table from profile_idle.device_idle's report of `steps` steps."""
    if rep is None:
        return f"| batch {batch} | {1e3 * itl:.2f} | - | - | - | - | no device events in the trace |"
    top = ", ".join(f"{name[:40]} {1e3 * t / steps:.3f}" for name, t in rep["top"][:4])
    return (
        f"| batch {batch} | {1e3 * itl:.2f} | {1e3 * rep['busy_s'] / steps:.2f} | "
        f"{100 * rep['idle_fraction']:.1f}% | {rep['kernels'] / steps:.0f} | "
        f"{rep['copies'].get('d2h', 0) / steps:.1f} ({1e3 * rep['idle_after_d2h_s'] / steps:.3f}) | {top} |"
    )


def run_hf_shape(args, batches):
    """HF transformers on random weights of the shape (benchmarks/hf_baseline.py under
    --hf-python), saved to a temporary directory: (its JSON result, the weights' directory)."""
    from shapes import hf_config

    workdir = Path(tempfile.mkdtemp(prefix=f"hf-{args.shape}-"))
    (workdir / "shape.json").write_text(json.dumps(hf_config(args.shape)))
    cmd = [
        args.hf_python,
        str(Path(__file__).with_name("hf_baseline.py")),
        "--shape-config",
        str(workdir / "shape.json"),
        "--save-dir",
        str(workdir / "weights"),
        "--batches",
        *map(str, batches),
        "--decode-prompt-len",
        str(args.prompt_lens[0]),
        "--decode-tokens",
        str(args.new_tokens),
        "--prompt-len",
        str(args.prefill_len),
        "--repeats",
        str(args.repeats),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1]), workdir / "weights"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--hf-python",
        default=None,
        help="a Python with torch + transformers for the baseline "
        "(with --shape: HF builds the random weights and both sides run them)",
    )
    ap.add_argument(
        "--llamacpp-python",
        default=None,
        help="with --shape and --hf-python: a Python with "
        "llama-cpp-python, run as a batch-1 peer on a float32 GGUF of the same weights",
    )
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stream-rates", type=float, nargs="+", default=[0.5, 1.0])
    ap.add_argument("--stream-requests", type=int, default=16)
    ap.add_argument(
        "--shape",
        default=None,
        help="random weights of this shape: smollm2, llama-3.2-1b, llama-3.1-8b, qwen3-30b-a3b, gemma-3-1b",
    )
    ap.add_argument(
        "--quantization",
        default=None,
        choices=["auto", "none", "gguf", "int8", "int4"],
        help="the default model: as LLM(quantization=...) (gguf: its own quantized blocks); "
        "with --shape: int8 or int4 of the random weights (made on the device)",
    )
    ap.add_argument("--layers", type=int, default=None, help="with --shape: only the first N layers (quick runs)")
    ap.add_argument("--dtype", default="auto", help="with --shape (auto: bfloat16 on accelerators, float32 on the CPU)")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 1024], help="with --shape")
    ap.add_argument("--new-tokens", type=int, default=32, help="with --shape: tokens decoded per request")
    ap.add_argument("--prefill-len", type=int, default=2048, help="with --shape: the prefill prompt's length")
    ap.add_argument("--startup", action="store_true", help="with --shape: time cold and warm start-up too")
    ap.add_argument(
        "--cache-dir",
        default="auto",
        help="compilation cache (with --shape): a directory, none, or auto "
        "($JAXINFER_COMPILATION_CACHE_DIR, else ~/.cache/jaxinfer/xla)",
    )
    ap.add_argument(
        "--token-buckets",
        type=int,
        nargs="+",
        default=None,
        help="with --shape: the engine's token buckets (default: powers of two up to the "
        "budget); fewer buckets compile fewer variants, for a large model's cold start",
    )
    ap.add_argument("--no-async-scheduling", action="store_true")
    ap.add_argument(
        "--num-decode-steps",
        type=int,
        default=None,
        help="with --shape: decode steps per jitted call (default: the engine's)",
    )
    ap.add_argument(
        "--greedy-variant",
        choices=["auto", "on", "off"],
        default="auto",
        help="with --shape: the decode step's greedy twin (EngineConfig.greedy_variant)",
    )
    ap.add_argument(
        "--dispatch-thread",
        choices=["auto", "on", "off"],
        default="auto",
        help="with --shape: launch steps from a thread (EngineConfig.dispatch_thread)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="with --shape: trace a decode run per --profile-batches and report the "
        "device's idle fraction and top kernels (benchmarks/profile_idle.py)",
    )
    ap.add_argument("--profile-batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument(
        "--host-profile",
        action="store_true",
        help="with --shape: cProfile a decode run per --profile-batches (host time)",
    )
    args = ap.parse_args()
    if args.profile:  # XLA:CPU traces its operations only with this flag, read as JAX starts
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {profile_idle.CPU_TRACE_FLAG}".strip()
    if args.llamacpp_python and not (args.shape and args.hf_python):
        ap.error("--llamacpp-python runs on the weights --shape with --hf-python writes")
    if args.layers is not None and (not args.shape or args.hf_python or args.layers < 1):
        ap.error(f"--layers {args.layers}: a positive count, with --shape and without --hf-python")
    if args.shape:
        return bench_shape(args)

    llm = LLM(
        max_num_seqs=32,
        max_num_batched_tokens=512,
        max_model_len=2048,
        penalties=False,
        **({"quantization": args.quantization} if args.quantization else {}),
    )
    variants = llm.engine.worker.num_compiled()
    ours = {"prefill_tokens_per_s": bench_prefill(llm, 256, args.repeats), "decode": {}}
    for b in args.batches:
        ours["decode"][str(b)] = statistics.median(bench_decode(llm, b, 64) for _ in range(args.repeats))
    streams = [bench_stream(llm, r, args.stream_requests) for r in args.stream_rates]
    assert llm.engine.worker.num_compiled() == variants, "a step compiled after warm-up"
    hf = run_hf(args.hf_python, args.batches, args.stream_rates, args.stream_requests)

    print(
        f"Hardware: {platform.processor() or platform.machine()}, {jax.device_count()} x "
        f"{jax.devices()[0].device_kind}; jax {jax.__version__}; float32; warm-up "
        f"{llm.engine.warm_up_seconds:.1f}s ({variants} variants)\n"
    )
    print("| metric | jaxinfer | HF transformers | ratio |\n|---|---|---|---|")
    rows = [("prefill tok/s (256-token prompt)", ours["prefill_tokens_per_s"], hf and hf["prefill_tokens_per_s"])]
    rows += [(f"decode tok/s, batch {b}", ours["decode"][str(b)], hf and hf["decode"][str(b)]) for b in args.batches]
    for name, a, b in rows:
        print(f"| {name} | {a:.1f} | {b:.1f} | {a / b:.2f}x |" if b else f"| {name} | {a:.1f} | - | - |")
    print("\n| engine | arrival rate (req/s) | req/s | output tok/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) |")
    print("|---|---|---|---|---|---|")
    rows = [("jaxinfer", s) for s in streams] + [
        ("HF generate, one at a time", s) for s in (hf or {}).get("streams", [])
    ]
    for name, s in rows:
        print(
            f"| {name} | {s['rate']} | {s['throughput_req_s']:.2f} | {s['output_tok_s']:.1f} | "
            f"{s['ttft_p50']:.2f} / {s['ttft_p99']:.2f} | {1000 * s['itl_p50']:.0f} / {1000 * s['itl_p99']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
