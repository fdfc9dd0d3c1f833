"""What quantization costs in quality: perplexity of one model on a fixed public-domain text under
float32, bfloat16, int8 / int4 weights and an int8 / fp8 KV cache, in one run.

    python benchmarks/bench_quality.py                         # SmolLM2 (embedded), KJV Genesis
    python benchmarks/bench_quality.py --tokens 2048 --configs bf16,kv-int8
    python benchmarks/bench_quality.py --text FILE --model PATH

The text: the King James Bible (1611, public domain) as Debian's `bible-kjv` package prints it
(`apt-get install bible-kjv`; its reader `bible` unpacks the text of `bible-kjv-text`), verse
numbers and chapter headings removed, the book of Genesis onward; or any file given as --text.
The first --tokens tokens are scored.

The engine has no prompt logprobs, so the text is scored teacher-forced with the model family's
own forward over the engine's own state: each configuration builds an `LLM` (weights loaded and
quantized as asked, the KV pool allocated by the runner, int8/fp8 scales calibrated as at any
start-up) and feeds the text through the runner's paged cache in windows of --window tokens, each
window in chunks of --chunk tokens as chunked prefill would (so every chunk after the first reads
its context back from the quantized cache). Token i + 1's log-probability is read from the
logits at token i; the first token of each window is only context. Perplexity is
exp(mean negative log-likelihood) over every scored token. "top-1 = f32" is the share of scored
positions whose most likely next token is float32's. Start-up (load, quantize, KV calibration) and
scoring times include their compiles.
"""

from __future__ import annotations

import argparse
import functools
import re
import shutil
import subprocess
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

CONFIGS = {  # name -> LLM keyword arguments (the base dtype of the quantized rows: --dtype)
    "f32": dict(dtype="float32"),
    "bf16": dict(dtype="bfloat16"),
    "int8": dict(quantization="int8"),
    "int8-g64": dict(quantization="int8", quantization_group_size=64),
    "int8-g32": dict(quantization="int8", quantization_group_size=32),
    "int4-g128": dict(quantization="int4", quantization_group_size=128),
    "int4-g64": dict(quantization="int4", quantization_group_size=64),
    "int4-g32": dict(quantization="int4", quantization_group_size=32),
    "kv-int8": dict(kv_cache_dtype="int8"),
    "kv-fp8": dict(kv_cache_dtype="fp8"),
}
KJV_RANGE = "gen1:1-rev22:21"


def kjv_text() -> str:
    """The KJV text from Debian's `bible` reader, one verse a line, chapters apart."""
    if shutil.which("bible") is None:
        raise SystemExit("the `bible` program is missing: apt-get install bible-kjv (Debian), or pass --text FILE")
    raw = subprocess.run(
        ["bible", KJV_RANGE], capture_output=True, text=True, check=True, stdin=subprocess.DEVNULL
    ).stdout
    verses, chapters = [], []
    for line in raw.splitlines():
        if re.fullmatch(r"\S.* \d+", line):  # "Genesis 1": a chapter heading
            if verses:
                chapters.append(" ".join(verses))
            verses = []
        elif m := re.match(r"\s+\d+ (.*)", line):  # "  1 In the beginning ...": a verse
            verses.append(m.group(1).strip())
        elif line.strip() and verses:  # the rest of a wrapped verse
            verses[-1] += " " + line.strip()
    chapters.append(" ".join(verses))
    return "\n\n".join(chapters)


MAX_GROUPS = 8  # the KV layout's layer groups the pool is sized for (config/kv_layout.py)


def _chunk_logprobs(family, config, attn_impl, params, kv_caches, tokens, targets, start, page_table):
    """One chunk of one sequence through the paged cache: (log p(target) f32[C], argmax i32[C],
    caches). tokens, targets i32[C]; start: tokens already in the cache."""
    from jaxinfer.models.layers import AttentionMetadata

    n = tokens.shape[0]
    meta = AttentionMetadata(
        kv_lens=(start + n).reshape(1),
        page_indices=page_table,
        cu_q_lens=jnp.array([0, n], jnp.int32),
        num_seqs=jnp.ones((1,), jnp.int32),
    )
    positions = start + jnp.arange(n, dtype=jnp.int32)
    hidden, kv_caches = family.forward(params, config, tokens, positions, kv_caches, meta, attn_impl=attn_impl)
    logits = family.compute_logits(params, hidden)  # f32[C, V]
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logprobs, targets[:, None], axis=1)[:, 0]
    return picked, jnp.argmax(logits, axis=-1).astype(jnp.int32), kv_caches


def score(runner, ids: np.ndarray, window: int, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced log-probabilities of ids[1:] per window (see the module docstring) through
    `runner`'s params and KV pool (one sequence on pages 1..n). Returns (logprobs f32[N],
    argmax predictions i32[N]) over the scored positions, in text order."""
    if window % chunk or window % runner.step.engine.cache.page_size:
        raise ValueError(f"--window {window} must be a multiple of --chunk {chunk} and the page size")
    step = jax.jit(
        functools.partial(
            _chunk_logprobs, runner.state.family, runner.state.config, runner.step.engine.compile.attn_impl
        ),
        donate_argnums=(1,),
        out_shardings=(None, None, jax.tree.map(lambda c: c.format, runner.state.kv_caches)),
    )
    pages = window // runner.step.engine.cache.page_size
    groups = runner.state.kv_layout.num_groups  # each layer group's table: pages of its own
    if groups * pages >= runner.state.num_pages:
        raise ValueError(f"{groups} layer groups of {pages} pages exceed the pool of {runner.state.num_pages}")
    page_table = jnp.arange(1, groups * pages + 1, dtype=jnp.int32).reshape(groups, 1, pages)
    logprobs, argmax = [], []
    for w0 in range(0, len(ids) - 1, window):
        seq = ids[w0 : w0 + window + 1]  # the window and the token after it (its last target)
        n_scored = len(seq) - 1
        for c0 in range(0, n_scored, chunk):
            tokens = np.zeros(chunk, np.int32)
            targets = np.zeros(chunk, np.int32)
            part = seq[c0 : min(c0 + chunk, n_scored)]
            tokens[: len(part)], targets[: len(part)] = part, seq[c0 + 1 : c0 + 1 + len(part)]
            lp, am, runner.state.kv_caches = step(
                runner.state.params,
                runner.state.kv_caches,
                jnp.asarray(tokens),
                jnp.asarray(targets),
                jnp.int32(c0),
                page_table,
            )
            logprobs.append(np.asarray(lp)[: len(part)])
            argmax.append(np.asarray(am)[: len(part)])
    return np.concatenate(logprobs), np.concatenate(argmax)


def run_config(name: str, args: argparse.Namespace, ids: np.ndarray) -> dict:
    from jaxinfer.llm import LLM

    kwargs = {"dtype": args.dtype, **CONFIGS[name]}
    start = time.perf_counter()
    pages = (args.window // args.page_size) * MAX_GROUPS + 2  # a table per layer group (Gemma 3: 6 or 7)
    llm = LLM(
        args.model,
        **kwargs,
        max_model_len=args.window,
        num_pages=pages,
        page_size=args.page_size,
        max_num_seqs=1,
        max_num_batched_tokens=args.chunk,
        warm_up=False,
        attn_impl=args.attn_impl,
    )
    runner = llm.engine.worker
    setup = time.perf_counter() - start
    start = time.perf_counter()
    logprobs, argmax = score(runner, ids, args.window, args.chunk)
    seconds = time.perf_counter() - start
    nll = float(-logprobs.mean())
    return {
        "name": name,
        "dtype": kwargs["dtype"],
        "kv": str(runner.state.kv_dtype),
        "nll": nll,
        "ppl": float(np.exp(nll)),
        "argmax": argmax,
        "setup_s": setup,
        "score_s": seconds,
        "tokens": len(logprobs),
    }


def table(results: list[dict], base: str) -> str:
    ran = [r for r in results if "error" not in r]
    ref = next((r for r in ran if r["name"] == base), ran[0])
    f32 = next((r for r in ran if r["name"] == "f32"), None)
    lines = [
        f"| config | weights dtype | KV dtype | perplexity | vs {ref['name']} | top-1 = f32 | start-up s | scoring s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:  # e.g. a group size that does not divide the model's dimensions
            lines.append(f"| {r['name']} | - | - | not run: {r['error']} | | | | |")
            continue
        agree = "" if f32 is None else f"{np.mean(r['argmax'] == f32['argmax']):.1%}"
        delta = (r["ppl"] / ref["ppl"] - 1) * 100
        lines.append(
            f"| {r['name']} | {r['dtype']} | {r['kv']} | {r['ppl']:.3f} | {delta:+.2f}% | "
            f"{agree} | {r['setup_s']:.0f} | {r['score_s']:.0f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M)")
    p.add_argument("--text", default=None, help="a UTF-8 text file (default: the KJV via `bible`)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens of the text to score")
    p.add_argument("--window", type=int, default=1024, help="tokens per independent window")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk (tokens per forward)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", help="the dtype of the quantized rows")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"from {list(CONFIGS)}")
    p.add_argument("--base", default="bf16", help="the row the others are compared with")
    p.add_argument("--attn-impl", default="auto")
    args = p.parse_args(argv)
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown --configs {unknown}; known: {list(CONFIGS)}")

    from jaxinfer.loader import load_model

    text = Path(args.text).read_text(encoding="utf-8") if args.text else kjv_text()
    tokenizer = load_model(args.model, "float32").tokenizer
    ids = np.asarray(tokenizer.encode(text), np.int32)[: args.tokens]
    if len(ids) < 2:
        raise SystemExit(f"the text gives {len(ids)} tokens; nothing to score")
    print(
        f"{len(ids)} tokens, windows of {args.window}, chunks of {args.chunk}, backend {jax.default_backend()}",
        flush=True,
    )
    results = []
    for name in names:
        try:
            r = run_config(name, args, ids)
        except ValueError as e:  # an option this model cannot take: a row that says why
            results.append({"name": name, "error": str(e)})
            print(f"{name}: not run: {e}", flush=True)
            continue
        results.append(r)
        print(f"{name}: perplexity {r['ppl']:.3f} (setup {r['setup_s']:.1f}s, scoring {r['score_s']:.1f}s)", flush=True)
    print()
    print(table(results, args.base))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
