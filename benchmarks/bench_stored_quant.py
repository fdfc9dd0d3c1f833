"""Checkpoints stored quantized (compressed-tensors) against the float model, side by side in one
run: decode tokens/s at batch 1, parameter bytes against bfloat16, perplexity on a fixed text.

    python benchmarks/bench_stored_quant.py                          # SmolLM2 (embedded), this CPU
    python benchmarks/bench_stored_quant.py --schemes W8A8,W4A16-G64 --runs 5

Each scheme's checkpoint is written from the source model by benchmarks/ct_checkpoint.py (what
llm-compressor's data-free schemes write, byte for byte on the test fixtures) into a temporary
directory and served as stored (quantization "auto"). Decode: one prompt, greedy, the time of
`--new` tokens minus the time of one (the prefill), median of --runs after a warm-up run, with
every engine loaded and warmed up first (nothing compiles in the timed runs) and the runs taken
in turn, one of each checkpoint per round. Bytes: the parameter arrays of a
bfloat16 load. Perplexity: tests/fixtures/gemma3_270m's Python-license prose, 512 tokens scored
teacher-forced in windows of 256 (bench_quality.score), float32. The float row is the source
loaded without quantization (the embedded SmolLM2: its Q4_1 blocks dequantized at load).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_quality  # noqa: E402
import ct_checkpoint  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
TEXT = ROOT / "tests" / "fixtures" / "gemma3_270m" / "golden_meta.json"


def decode_rates(paths: dict[str, str | None], runs: int, new: int) -> dict[str, float]:
    """Each checkpoint's decode tokens/s, every engine loaded first and the timed runs taken in
    turn (one run of each per round), so that a drift of the machine's speed touches all alike."""
    from jaxinfer.llm import LLM
    from jaxinfer.sampling import SamplingParams

    engines = {
        name: LLM(path, "float32", max_model_len=256, max_num_seqs=1, token_buckets=(1, 32), max_num_batched_tokens=32)
        for name, path in paths.items()
    }

    def timed(llm: LLM, n: int) -> float:
        start = time.perf_counter()
        prompt = llm.tokenizer.encode(PROMPT)
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start

    for llm in engines.values():
        timed(llm, new)  # warm: every variant the timed runs use
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(runs):
        for name, llm in engines.items():
            rates[name].append((new - 1) / (timed(llm, new) - timed(llm, 1)))
    return {name: statistics.median(r) for name, r in rates.items()}


def perplexity(path: str | None, ids: np.ndarray) -> float:
    from jaxinfer.llm import LLM

    llm = LLM(path, "float32", max_model_len=256, num_pages=40, page_size=16, max_num_seqs=1,
              max_num_batched_tokens=128, warm_up=False)  # fmt: skip
    logprobs, _ = bench_quality.score(llm.engine.worker, ids, window=256, chunk=128)
    return float(np.exp(-logprobs.mean()))


def param_bytes_bf16(path: str | None) -> int:
    from jaxinfer.loader import load_model
    from jaxinfer.quant import QuantConfig, param_bytes

    return param_bytes(load_model(path, "bfloat16", with_tokenizer=False, quantization=QuantConfig("auto")).params)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="source: HF directory or GGUF (default: the embedded SmolLM2)")
    p.add_argument("--schemes", default="W4A16-G32,W4A16-G64,W8A16,W8A8,FP8-DYNAMIC")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--new", type=int, default=65, help="tokens generated per timed run")
    args = p.parse_args(argv)

    import jax

    from jaxinfer.loader import load_model

    tokenizer_dir = ROOT / "tests" / "fixtures" / "smollm2"
    ids = np.asarray(load_model(args.model, "float32").tokenizer.encode(json.loads(TEXT.read_text())["long_text"]))
    ids = ids[:513].astype(np.int32)
    tensors, config = ct_checkpoint.hf_tensors(args.model)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths: dict[str, str | None] = {"float": args.model}
        for name in args.schemes.split(","):
            dst = ct_checkpoint.write(tensors, config, Path(tmp) / name, name)
            for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
                (dst / f).write_bytes((tokenizer_dir / f).read_bytes())
            paths[name] = str(dst)
        rates = decode_rates(paths, args.runs, args.new)
        for name, path in paths.items():
            rows.append(
                {"name": name, "tok_s": rates[name], "ppl": perplexity(path, ids), "bytes": param_bytes_bf16(path)}
            )
            print(json.dumps(rows[-1]), flush=True)
    base = rows[0]
    print(f"\nbackend {jax.default_backend()}, {jax.devices()[0].device_kind}; batch 1, median of {args.runs}")
    print("| checkpoint | decode tok/s | vs float | param bytes vs bf16 | perplexity | vs float |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['name']} | {r['tok_s']:.1f} | {r['tok_s'] / base['tok_s']:.2f}x | "
            f"{r['bytes'] / base['bytes']:.3f}x | {r['ppl']:.3f} | {r['ppl'] / base['ppl'] - 1:+.1%} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
