"""llama.cpp (llama-cpp-python) as a peer of bench_engine.py on the same weights.

    python benchmarks/llamacpp_peer.py --gguf model.gguf [--prompt-len 64] [--new-tokens 32] [--repeats 3]

Run under a Python that has `llama_cpp` (llama-cpp-python from PyPI; a source package that builds
llama.cpp on install), as bench_engine.py does with `--llamacpp-python`, so it never enters this
project's environment. It decodes greedily at batch 1 after a random prompt, one token per
`eval` (llama.cpp's own decode step), on every core, and prints one JSON line: decode tokens/s
(median over repeats of new_tokens / decode time) and the library's version.

`write_gguf` (imported by bench_engine.py and bench_load.py, in this project's environment) writes an HF
directory's llama-family tensors as a float32 (or float16) GGUF the way llama.cpp's converter names and lays
them out (q and k rows permuted for its RoPE), with a placeholder vocabulary of the model's size,
so llama.cpp runs the very weights the engine and HF transformers run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path


def _permute_for_rope(w, heads: int):
    """HF's q / k rows [heads * D, E] in llama.cpp's order (its converter's permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir: Path, path: Path, dtype: str = "float32") -> None:
    """A GGUF (float32 or float16 tensors) of an HF llama-family directory, with a vocabulary of
    placeholder pieces (llama.cpp needs one to load; the benchmarks feed token ids)."""
    import gguf
    import numpy as np

    from checkpoints import SafetensorsCheckpoint
    from jaxinfer.config import ModelConfig
    from jaxinfer.models.registry import get_family

    config = ModelConfig.from_hf_file(hf_dir / "config.json")
    if config.family != "llama":
        raise ValueError(f"{hf_dir}: llama.cpp peer writes llama-family models, not {config.family!r}")
    reader = SafetensorsCheckpoint(hf_dir)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in [
        ("block_count", config.num_layers),
        ("context_length", config.max_position_embeddings),
        ("embedding_length", config.hidden_size),
        ("feed_forward_length", config.intermediate_size),
        ("attention.head_count", config.num_heads),
        ("attention.head_count_kv", config.num_kv_heads),
        ("rope.dimension_count", config.head_dim),
        ("vocab_size", config.vocab_size),
    ]:
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.rope.freq_base", config.rope_theta)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    writer.add_tokenizer_model("llama")
    pieces = [f"<0x{i:02X}>" for i in range(256)] + [f"<t{i}>" for i in range(256, config.vocab_size)]
    writer.add_token_list(pieces)
    writer.add_token_scores([0.0] * config.vocab_size)
    writer.add_token_types([6] * 256 + [1] * (config.vocab_size - 256))  # 6: byte, 1: normal
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    family = get_family(config.family)
    for hf, gg in zip(family.checkpoint_specs(config, "hf"), family.checkpoint_specs(config, "gguf")):
        w = np.asarray(reader.get(hf.name), np.float32)
        if gg.name.endswith("attn_q.weight"):
            w = _permute_for_rope(w, config.num_heads)
        elif gg.name.endswith("attn_k.weight"):
            w = _permute_for_rope(w, config.num_kv_heads)
        writer.add_tensor(gg.name, w.astype(dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def run_peer(python: str, hf_dir: Path, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    """Writes hf_dir's weights as a float32 GGUF beside it and runs this script on it under
    `python` (one with llama_cpp): its JSON result."""
    gguf_path = hf_dir.parent / "model-f32.gguf"
    write_gguf(hf_dir, gguf_path)
    cmd = [
        python,
        __file__,
        "--gguf",
        str(gguf_path),
        "--prompt-len",
        str(prompt_len),
        "--new-tokens",
        str(new_tokens),
        "--repeats",
        str(repeats),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"llama.cpp peer failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def decode_rate(llm, vocab: int, prompt_len: int, new_tokens: int, seed: int) -> float:
    """Greedy batch-1 decode tokens/s after a random prompt (llama.cpp's KV cache reset first)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    llm.reset()
    llm.eval(rng.integers(256, vocab, prompt_len).tolist())
    token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    start = time.perf_counter()
    for _ in range(new_tokens):
        llm.eval([token])
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    return new_tokens / (time.perf_counter() - start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import llama_cpp

    threads = os.cpu_count() or 1
    llm = llama_cpp.Llama(
        args.gguf,
        n_ctx=args.prompt_len + args.new_tokens + 8,
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=max(args.prompt_len, 8),
        logits_all=True,
        verbose=False,
    )
    vocab = llm.n_vocab()
    decode_rate(llm, vocab, args.prompt_len, 4, seed=99)  # warm-up
    rates = [decode_rate(llm, vocab, args.prompt_len, args.new_tokens, seed) for seed in range(args.repeats)]
    print(
        json.dumps({"llama_cpp": llama_cpp.__version__, "threads": threads, "decode": {"1": statistics.median(rates)}})
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
