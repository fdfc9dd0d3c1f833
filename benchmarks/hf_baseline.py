"""HF transformers baseline for bench_engine.py, run in a separate Python with torch installed.

    /path/to/python-with-torch benchmarks/hf_baseline.py GGUF_PATH --batches 1 8 32
    /path/to/python-with-torch benchmarks/hf_baseline.py --shape-config CONFIG.json --save-dir DIR

Prints one JSON object: prefill tokens/s and decode tokens/s per batch size (float32 on the CPU,
bfloat16 on a GPU). With --shape-config it first builds random weights of that HF LlamaConfig and
saves them to --save-dir as safetensors, so bench_engine.py --shape runs the engine on the same
weights; decode then uses --prompt-len-token prompts.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

sys.path.insert(0, str(Path(__file__).parent))
from workload import make_workload, summarize  # noqa: E402


class _Clock(BaseStreamer):
    """Timestamps every token generate emits (the first put() is the prompt)."""

    def __init__(self):
        self.times = []
        self.calls = 0

    def put(self, value):
        self.calls += 1
        if self.calls > 1:
            self.times.append(time.monotonic())

    def end(self):
        pass


def serve_stream(model, rate, num_requests):
    """FCFS, one request at a time (HF generate has no continuous batching)."""
    start = time.monotonic()
    ttft, itl, tokens = [], [], 0
    for arrival, prompt, max_tokens in make_workload(rate, num_requests):
        time.sleep(max(0.0, start + arrival - time.monotonic()))
        clock = _Clock()
        model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
            streamer=clock,
        )
        ttft.append(clock.times[0] - (start + arrival))
        itl += [b - a for a, b in zip(clock.times, clock.times[1:])]
        tokens += len(clock.times)
    return summarize(ttft, itl, num_requests, tokens, time.monotonic() - start, rate)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _random_model(config_path, save_dir, device):
    """Random weights of a HF LlamaConfig, saved as safetensors for the engine to load."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**json.loads(Path(config_path).read_text()))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    if save_dir:
        model.save_pretrained(save_dir, safe_serialization=True)
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf", nargs="?", default=None)
    ap.add_argument("--shape-config", default=None, help="a HF LlamaConfig JSON: random weights")
    ap.add_argument("--save-dir", default=None, help="with --shape-config: where to save them")
    ap.add_argument("--decode-prompt-len", type=int, default=16)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stream-rates", type=float, nargs="*", default=[])
    ap.add_argument("--stream-requests", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.shape_config:
        model = _random_model(args.shape_config, args.save_dir, device)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(args.gguf), gguf_file=os.path.basename(args.gguf), torch_dtype=torch.float32
        )
    model.eval()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    import transformers

    result = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "decode": {},
    }
    with torch.no_grad():
        prompt = torch.randint(1, min(40000, vocab), (1, args.prompt_len), generator=gen).to(model.device)
        model(prompt)  # warm-up
        times = []
        for _ in range(args.repeats):
            _sync()
            t = time.perf_counter()
            model(prompt)
            _sync()
            times.append(time.perf_counter() - t)
        result["prefill_tokens_per_s"] = args.prompt_len / statistics.median(times)
        for b in args.batches:
            ids = torch.randint(1, min(40000, vocab), (b, args.decode_prompt_len), generator=gen).to(model.device)
            kw = dict(
                max_new_tokens=args.decode_tokens, min_new_tokens=args.decode_tokens, do_sample=False, pad_token_id=0
            )
            model.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
            runs = []
            for _ in range(args.repeats):
                _sync()
                t0 = time.perf_counter()
                model.generate(ids, **{**kw, "max_new_tokens": 1, "min_new_tokens": 1})
                _sync()
                t1 = time.perf_counter()
                model.generate(ids, **kw)
                _sync()
                t2 = time.perf_counter()
                # decode-only time: the full run minus a prefill-plus-one-token run
                runs.append(b * (args.decode_tokens - 1) / ((t2 - t1) - (t1 - t0)))
            result["decode"][str(b)] = statistics.median(runs)
        result["streams"] = [serve_stream(model, r, args.stream_requests) for r in args.stream_rates]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
