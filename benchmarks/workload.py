"""The Poisson request stream shared by bench_engine.py and hf_baseline.py (numpy only).

Both sides draw the identical workload from the same seed: arrival times, prompt token ids
(32..512 tokens) and output lengths (16..128 tokens, generated with EOS ignored).
"""
import numpy as np


def make_workload(rate: float, num_requests: int, seed: int = 0):
    """-> list of (arrival seconds from start, prompt ids, max new tokens)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, num_requests))
    out = []
    for t in arrivals:
        prompt = rng.integers(100, 40000, int(rng.integers(32, 513))).tolist()
        out.append((float(t), prompt, int(rng.integers(16, 129))))
    return out


def summarize(ttft, itl, num_requests, tokens, elapsed, rate):
    pct = lambda v, q: float(np.percentile(v, q)) if len(v) else float("nan")  # noqa: E731
    return {"rate": rate, "requests": num_requests, "throughput_req_s": num_requests / elapsed,
            "output_tok_s": tokens / elapsed, "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99)}
