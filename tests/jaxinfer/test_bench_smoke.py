"""benchmarks/bench_engine.py --shape: random weights of a real shape, decode and prefill beside
their floors, on tiny settings (the same code runs unchanged on a GPU at full size)."""
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_engine.py"


def test_bench_engine_shape_smoke(tmp_path):
    argv = [sys.executable, str(BENCH), "--shape", "smollm2", "--batches", "1", "2", "--prompt-lens", "8",
            "--new-tokens", "6", "--prefill-len", "32", "--cache-dir", str(tmp_path),
            "--profile", "--host-profile", "--profile-batches", "2"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| decode") or line.startswith("| prefill")]
    assert len(rows) == 3, out.stdout
    for row in rows:
        rate, step_ms, floor_ms, pct = [c.strip() for c in row.split("|")[2:6]]
        # The floor comes from a copy rate measured on a busy 2-core CPU (noisy): a sanity bound.
        assert float(rate) > 0 and float(step_ms) > 0.5 * float(floor_ms) > 0 and pct.endswith("%")
    assert "Measured ceilings: copy" in out.stdout and "0.50 GiB of weights" in out.stdout
    assert "decode windows of 8 steps" in out.stdout
    # --profile: the CPU trace has no device kernels, which the row says; --host-profile: cProfile.
    assert "| batch 2 |" in out.stdout and "no device events in the trace" in out.stdout
    assert "## Host profile, decode batch 2" in out.stdout and "run_engine_decode" in out.stdout
