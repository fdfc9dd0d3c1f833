"""What serving LoRA adapters costs: decode tokens/s of a batch under many adapters against the
same batch on the base model, one engine, one run.

    python benchmarks/bench_lora.py                         # SmolLM2 (embedded), 8 requests, rank 16
    python benchmarks/bench_lora.py --batch 8 --adapters 8 --rank 16 --max-tokens 128 --rounds 3
    python benchmarks/bench_lora.py --model PATH --dtype bfloat16 --batch 64 --adapters 16
    python benchmarks/bench_lora.py --shape llama-3.1-8b --batch 64 --adapters 16   # a GPU

One LLM with LoRA on (`max_loras` = the adapter count, `max_lora_rank` = the rank) serves, round
after round, the same `--batch` requests (greedy, `ignore_eos`, the same prompts) three ways:
  base       every request on the base model (the engine's LoRA slots bound to none)
  one        every request under one adapter
  many       request i under adapter i mod --adapters (every slot in use)
Per way: decode tokens/s over the batch (tokens after each request's first, over the time from the
batch's last first token to its last token; medians over --rounds), and its ratio to `base`.
Adapters are random PEFT adapters on all seven modules (tests/support/lora_adapters.py), written
to a temporary directory; the first round loads them into the slots and is not counted. The
engine without LoRA is timed too (`off`), to show what the slots cost when no request uses them.
With --shape, the model is random bfloat16 weights of that shape (benchmarks/shapes.py; --layers
keeps its first layers), the prompts random token ids of --prompt-len, and both engines get
--kv-gib of KV cache each (they share one copy of the weights on the device).

    python benchmarks/bench_lora.py --load-shape llama-3.1-8b --rank 16

times instead what loading one adapter of that model's shape (all seven modules) costs, disk to
device slot, as the engine does it: read and checked (jaxinfer.lora.peft), each layer's slot
arrays built (jaxinfer.lora.stacking), copied to the device and written into one slot of
`max_loras` stacked slots by one jitted, donating update (worker/lora_state.py's write). Medians
of --rounds, on whatever device JAX has.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from lora_adapters import write_random_adapter  # noqa: E402
from shapes import random_model  # noqa: E402

from jaxinfer.config.lora import LINEAR_MODULES  # noqa: E402
from jaxinfer.llm import LLM  # noqa: E402
from jaxinfer.lora import LoRARequest  # noqa: E402
from jaxinfer.lora.peft import module_shapes  # noqa: E402
from jaxinfer.sampling import SamplingParams  # noqa: E402

QUESTIONS = [
    "Give me three tips for sleeping better.",
    "Explain photosynthesis to a ten-year-old.",
    "Write a short email asking my manager for a day off next Friday.",
    "What is the capital of France? Answer in one sentence.",
]


def decode_rate(outs) -> float:
    """Tokens after each request's first, over the stretch where the whole batch decodes."""
    start = max(o.metrics.first_token_time for o in outs)
    end = max(o.metrics.last_token_time for o in outs)
    tokens = sum(sum(1 for _ in o.outputs[0].token_ids) - 1 for o in outs)
    return tokens / (end - start)


def run(llm, prompts, params, loras) -> float:
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    return decode_rate(outs)


def load_time(shape: str, rank: int, rounds: int, slots: int = 4) -> int:
    """Disk -> host -> device slot times of one rank-`rank` adapter of `shape` (module docstring)."""
    import jax.numpy as jnp
    from shapes import shape_config

    from jaxinfer.lora import read_adapter
    from jaxinfer.lora.stacking import layer_slot, slot_shapes

    config = shape_config(shape)
    path = Path(tempfile.mkdtemp(prefix="bench_lora_")) / "adapter"
    dims = module_shapes(config)
    write_random_adapter(
        path,
        num_layers=config.num_layers,
        dims=dims,
        target_modules=list(LINEAR_MODULES),
        r=rank,
        lora_alpha=2 * rank,
        use_rslora=False,
        seed=0,
    )
    shapes = slot_shapes(config, rank)
    stacks = [
        (jnp.zeros((slots, *a), jnp.bfloat16), jnp.zeros((slots, *b), jnp.bfloat16))
        for _ in range(config.num_layers)
        for a, b in shapes.values()
    ]
    write = jax.jit(
        lambda stacks, i, new: [(a.at[i].set(na), b.at[i].set(nb)) for (a, b), (na, nb) in zip(stacks, new)],
        donate_argnums=0,
    )
    times: dict[str, list[float]] = {"read + check": [], "to the slot": []}
    for r in range(rounds + 1):
        start = time.perf_counter()
        adapter = read_adapter(path, config, rank)
        read = time.perf_counter()
        new = [
            (jax.device_put(a), jax.device_put(b))
            for i in range(config.num_layers)
            for a, b in layer_slot(adapter, config, rank, i, np.dtype(jnp.bfloat16)).values()
        ]
        stacks = write(stacks, jnp.int32(r % slots), new)
        jax.block_until_ready(stacks)
        if r:  # the first round compiles the write
            times["read + check"].append(read - start)
            times["to the slot"].append(time.perf_counter() - read)
    size = sum(a.nbytes + b.nbytes for a, b in adapter.weights.values())
    print(
        f"{shape} adapter, rank {rank}, all modules: {size / 2**20:.0f} MiB float32 on disk; "
        f"{slots} bfloat16 slots on {jax.devices()[0].device_kind}; {time.strftime('%Y-%m-%d')}"
    )
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.3f} s | {', '.join(f'{v:.3f}' for v in values)} |")
    print(
        f"| disk to slot | {statistics.median(times['read + check']) + statistics.median(times['to the slot']):.3f} s |"
    )
    return 0


def prompts_and_engines(args):
    """(prompts, the engine without LoRA, the engine with it): the embedded or --model checkpoint
    with chat prompts, or random weights of --shape with token-id prompts (module docstring)."""
    lora = dict(enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank, lora_dtype=args.lora_dtype)
    if args.shape is None:
        options = dict(max_num_seqs=max(8, args.batch), max_model_len=512)
        off = LLM(args.model, args.dtype, **options)
        llm = LLM(args.model, args.dtype, **options, **lora)
        chats = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(args.batch)]
        return [llm.render_chat(chat) for chat in chats], off, llm
    model = random_model(args.shape, "bfloat16", num_layers=args.layers)
    options = dict(
        max_num_seqs=args.batch,
        max_model_len=args.prompt_len + args.max_tokens + 16,
        max_num_batched_tokens=2048,
        token_buckets=(args.batch, 2048),
        kv_cache_bytes=int(args.kv_gib * 2**30),
    )
    rng = np.random.default_rng(0)
    vocab = min(model.config.vocab_size, 32000)
    prompts = [rng.integers(1, vocab, args.prompt_len).tolist() for _ in range(args.batch)]
    return prompts, LLM(model, **options), LLM(model, **options, **lora)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lora-dtype", default="auto", help="the LoRA slots' dtype (LoraConfig.lora_dtype)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--load-shape", default=None, help="time loading one adapter of this shape instead")
    p.add_argument("--shape", default=None, help="random bfloat16 weights of this shape (benchmarks/shapes.py)")
    p.add_argument("--layers", type=int, default=None, help="with --shape: only its first layers")
    p.add_argument("--prompt-len", type=int, default=256, help="with --shape: random token-id prompts")
    p.add_argument("--kv-gib", type=float, default=8.0, help="with --shape: KV cache of each engine")
    args = p.parse_args(argv)
    if args.load_shape is not None:
        return load_time(args.load_shape, args.rank, args.rounds)
    prompts, off, llm = prompts_and_engines(args)
    config = llm.engine.model.config
    root = Path(tempfile.mkdtemp(prefix="bench_lora_"))
    names = []
    for i in range(args.adapters):
        write_random_adapter(
            root / f"a{i}",
            num_layers=config.num_layers,
            dims=module_shapes(config),
            target_modules=list(LINEAR_MODULES),
            r=args.rank,
            lora_alpha=2 * args.rank,
            use_rslora=False,
            seed=i,
        )
        names.append(LoRARequest(f"a{i}", i + 1, str(root / f"a{i}")))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    ways = {
        "off": (off, None),
        "base": (llm, None),
        "one": (llm, [names[0]] * args.batch),
        "many": (llm, [names[i % args.adapters] for i in range(args.batch)]),
    }
    for engine, loras in ways.values():  # warm: every adapter in its slot, every variant run
        run(engine, prompts, params, loras)
    rates: dict[str, list[float]] = {w: [] for w in ways}
    for _ in range(args.rounds):
        for way, (engine, loras) in ways.items():
            rates[way].append(run(engine, prompts, params, loras))
    base = statistics.median(rates["base"])
    source = args.shape or args.model or "SmolLM2-135M-Instruct"
    print(
        f"{source}: {args.batch} requests x {args.max_tokens} tokens, {args.adapters} adapters of rank "
        f"{args.rank} ({args.lora_dtype} slots), {jax.devices()[0].device_kind}, {time.strftime('%Y-%m-%d')}, "
        f"rounds {args.rounds}"
    )
    print("| way | decode tok/s (median) | runs | / base |\n|---|---|---|---|")
    for way, values in rates.items():
        med = statistics.median(values)
        print(f"| {way} | {med:.1f} | {', '.join(f'{v:.1f}' for v in values)} | {med / base:.2f} |")
    print(f"loads into slots: {llm.engine.lora.num_loads}; compiled variants {llm.engine.worker.num_compiled()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
