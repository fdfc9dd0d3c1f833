"""The Poisson request stream shared by bench_engine.py and hf_baseline.py (numpy only), and
the steady-state inter-token latency of a decode run.

Both sides draw the identical workload from the same seed: arrival times, prompt token ids
(32..512 tokens) and output lengths (16..128 tokens, generated with EOS ignored).
"""

import statistics

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
    return {
        "rate": rate,
        "requests": num_requests,
        "throughput_req_s": num_requests / elapsed,
        "output_tok_s": tokens / elapsed,
        "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99),
        "itl_p50": pct(itl, 50),
        "itl_p99": pct(itl, 99),
    }


def steady_itl(metrics) -> float:
    """Median inter-token latency while the whole batch decodes: the gaps between the last
    request's first token (before it, decodes share steps with other prompts' prefill) and the
    first request's last token (after it, the batch shrinks). A run too short to have such a
    stretch is refused: ask for more new tokens."""
    start = max(m.first_token_time for m in metrics)
    end = min(m.last_token_time for m in metrics)
    steady = []
    for m in metrics:
        t = m.first_token_time
        for gap in m.inter_token_latencies:
            if t >= start and t + gap <= end + 1e-9:
                steady.append(gap)
            t += gap
    if not steady:
        raise SystemExit(
            f"no stretch where all {len(metrics)} requests decode together: "
            "raise --new-tokens (prefill of the batch outlasts the first requests)"
        )
    return statistics.median(steady)
