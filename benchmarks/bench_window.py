"""How many long sequences fit one KV memory when sliding-window layers keep only their window.

    python benchmarks/bench_window.py                    # Gemma 2 / 3 shapes, 32k contexts, 16 GiB
    python benchmarks/bench_window.py --context 32768 --kv-gib 16 --chunk 512 --page-size 16

For each model shape, the same KV memory (--kv-gib, bfloat16) is laid out two ways and filled by
the engine's own KVCacheManager (no device: the pages' bytes are counted, not allocated):
  one group    every layer holds every page of the context (the layout before sliding-window
               layers kept only their window): pages = memory / (layers x one layer's page)
  groups       the model's KV layout (config/kv_layout.py): pages = memory / (caches x one
               layer's page), a page table per group, sliding groups giving back what left the window
Sequences are admitted one after another and each computed to --context tokens in steps of
--chunk tokens (the largest a step gives one sequence), all of them kept; the count is how many
reach the full context before a step's pages no longer fit. The ratio groups / one group is the
goal's measure (>= 4x for Gemma 3 at 32k).

Then the host's cost of the groups: the time of one decode step's `allocate` over --batch
sequences at the full context, both layouts (median of --rounds), as a ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

from jaxinfer.config import ModelConfig
from jaxinfer.config.kv_layout import kv_layout
from jaxinfer.config.sources import pattern_layer_types
from jaxinfer.core.replica import kv_groups
from jaxinfer.core.sequence import Sequence
from jaxinfer.kv import FullAttention, KVCacheManager
from jaxinfer.sampling import SamplingParams

# name: (layers, every n-th layer global (0: alternating from the first), window, KV heads, head dim)
SHAPES = {
    "gemma3-270m": (18, 6, 512, 1, 256),
    "gemma3-4b": (34, 6, 1024, 4, 256),
    "gemma3-27b": (62, 6, 1024, 16, 128),
    "gemma2-9b": (42, 2, 4096, 8, 256),
}


def shape_config(name: str) -> ModelConfig:
    layers, period, window, kv_heads, head_dim = SHAPES[name]
    return ModelConfig(
        family="gemma",
        model_type="gemma3_text",
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_layers=layers,
        num_heads=kv_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        sliding_window=window,
        layer_types=pattern_layer_types(layers, period),
    )


def fill(kv: KVCacheManager, context: int, chunk: int) -> tuple[int, list[Sequence]]:
    """Sequences computed to `context` tokens, one after another, until one's step does not fit."""
    done: list[Sequence] = []
    params = SamplingParams(max_tokens=1)
    while True:
        seq = Sequence(len(done), str(len(done)), list(range(context)), params, seed=0, arrival=0.0)
        while seq.num_computed_tokens < context:
            end = min(seq.num_computed_tokens + chunk, context)
            if not kv.allocate(seq, end):
                kv.free(seq)
                return len(done), done
            seq.num_computed_tokens = end
        done.append(seq)


def decode_seconds(kv: KVCacheManager, seqs: list[Sequence], rounds: int) -> float:
    """Median time of one decode step's allocate over `seqs` (each one token further)."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for seq in seqs:
            seq.token_ids.append(0)
            kv.allocate(seq, seq.num_tokens)
            seq.num_computed_tokens = seq.num_tokens
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--kv-gib", type=float, default=16.0)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=50)
    args = p.parse_args(argv)
    print(
        "| shape | layers (global) | window | caches, groups | seqs, one group | seqs, groups | ratio "
        "| decode step's allocate, groups / one group |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        config = shape_config(name)
        layout = kv_layout(config)
        layer_page = args.page_size * 2 * config.num_kv_heads * config.head_dim * 2  # K and V, bfloat16
        budget = int(args.kv_gib * 2**30)
        one_group = [FullAttention()]
        before = KVCacheManager(budget // (layer_page * config.num_layers) + 1, args.page_size, groups=one_group)
        after = KVCacheManager(budget // (layer_page * layout.num_caches) + 1, args.page_size, groups=kv_groups(layout))
        n_before, seqs_before = fill(before, args.context, args.chunk)
        n_after, seqs_after = fill(after, args.context, args.chunk)
        batch = min(args.batch, n_before, n_after)
        for kv, seqs in ((before, seqs_before), (after, seqs_after)):  # room for the decode tokens
            for seq in seqs[batch:]:
                kv.free(seq)
        t_after = decode_seconds(after, seqs_after[:batch], args.rounds) / batch
        t_before = decode_seconds(before, seqs_before[:batch], args.rounds) / batch
        globals_ = sum(w is None for w in (config.layer_window(i) for i in range(config.num_layers)))
        print(
            f"| {name} | {config.num_layers} ({globals_}) | {config.sliding_window} | "
            f"{layout.num_caches}, {layout.num_groups} | {n_before} | {n_after} | "
            f"{n_after / max(n_before, 1):.2f}x | {t_after * 1e6:.1f} / {t_before * 1e6:.1f} us per sequence |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
