"""benchmarks/bench_engine.py --shape: random weights of a real shape, decode and prefill beside
their floors, on tiny settings (the same code runs unchanged on a GPU at full size)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_engine.py"


def test_bench_engine_shape_smoke(tmp_path):
    argv = [
        sys.executable,
        str(BENCH),
        "--shape",
        "smollm2",
        "--layers",
        "2",
        "--batches",
        "1",
        "2",
        "--prompt-lens",
        "8",
        "--new-tokens",
        "6",
        "--prefill-len",
        "32",
        "--cache-dir",
        str(tmp_path),
        "--profile",
        "--host-profile",
        "--profile-batches",
        "2",
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| decode") or line.startswith("| prefill")]
    assert len(rows) == 3, out.stdout
    copy_gbs = float(re.search(r"Measured ceilings: copy ([\d.]+) GB/s", out.stdout)[1])
    for row in rows:
        rate, step_ms, floor_ms, pct = [c.strip() for c in row.split("|")[2:6]]
        step_ms, floor_ms = float(step_ms), float(floor_ms)
        assert float(rate) > 0 and step_ms > 0 and floor_ms > 0
        assert abs(float(pct.rstrip("%")) - 100 * floor_ms / step_ms) <= 1, row
        if row.startswith("| decode"):
            # At least the weights (0.13 GiB) over the measured copy rate. The step itself is not
            # held to the floor: that rate comes from a noisy 2-core CPU, sometimes busy.
            assert floor_ms >= 0.9 * 0.125 * 2**30 / (copy_gbs * 1e9) * 1e3, (row, copy_gbs)
    assert "Measured ceilings: copy" in out.stdout and "(2 of its layers, float32, 0.13 GiB of weights)" in out.stdout
    assert "decode windows of 8 steps" in out.stdout
    # --profile: on the CPU, XLA's operations on its own threads (traced with the flag the
    # benchmark sets) stand for the device's kernels; --host-profile: cProfile.
    prof = next(line for line in out.stdout.splitlines() if line.startswith("| batch 2 |"))
    cells = [c.strip() for c in prof.split("|")[1:-1]]
    assert float(cells[2]) > 0 and 0 <= float(cells[3].rstrip("%")) < 100 and float(cells[4]) > 0, prof
    assert "dot" in cells[6] or "fusion" in cells[6], prof
    assert "## Host profile, decode batch 2" in out.stdout and "run_engine_decode" in out.stdout


def test_bench_moe_smoke(tmp_path):
    """benchmarks/bench_moe.py on two layers of each shape, int8 weights (experts included): one
    table row per batch and prefill, each with a MoE / dense ratio, and the active parameters
    equal (the shapes are built so)."""
    argv = [
        sys.executable,
        str(BENCH.with_name("bench_moe.py")),
        "--layers",
        "2",
        "--batches",
        "4",
        "--prompt-len",
        "8",
        "--new-tokens",
        "8",
        "--prefill-len",
        "64",
        "--repeats",
        "1",
        "--quantization",
        "int8",
        "--cache-dir",
        str(tmp_path),
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split("|")[1:5] for line in out.stdout.splitlines() if line.startswith(("| decode", "| prefill"))]
    assert [r[0].strip() for r in rows] == [
        "decode step, batch 4",
        "prefill, one 64-token prompt",
    ]
    for _, dense, moe, ratio in rows:
        assert float(ratio.strip().rstrip("x")) == pytest.approx(float(moe) / float(dense), rel=0.02)
    active = re.search(r"smollm2 ([\d.]+)M \(all active\); smollm2-moe [\d.]+M, ([\d.]+)M active", out.stdout)
    assert active and float(active[2]) == pytest.approx(float(active[1]), rel=0.01), out.stdout
    assert "float32, weights int8;" in out.stdout


def test_bench_lm_head_smoke():
    """benchmarks/bench_lm_head.py --smoke: a row per weight form and row count, each timed."""
    bench = BENCH.with_name("bench_lm_head.py")
    out = subprocess.run([sys.executable, str(bench), "--smoke"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in out.stdout.splitlines() if line.startswith("| smoke")]
    assert [(r[1].strip(), int(r[2])) for r in rows] == [
        (form, m) for form in ("tied x.W^T", "tied W.x^T", "untied x.W") for m in (1, 8)
    ]
    assert all(float(r[3]) > 0 and float(r[4]) > 0 for r in rows), rows


def test_bench_host_smoke():
    """benchmarks/bench_host.py on a small plan: a row per context; later windows send only the
    entries of the pages they start, far less than the first window's whole rows."""
    bench = BENCH.with_name("bench_host.py")
    out = subprocess.run(
        [sys.executable, str(bench), "--batch", "16", "--contexts", "256", "1024", "--windows", "5"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in out.stdout.splitlines() if line.startswith("| 16 x")]
    assert [r[0].strip() for r in rows] == ["16 x 256", "16 x 1024"]
    for r in rows:
        prepare_ms, first_kib, later_kib = float(r[1]), float(r[3]), float(r[4])
        assert prepare_ms > 0 and later_kib < first_kib / 2, r


def test_bench_int4_forms_agree():
    """benchmarks/bench_int4.py (the int4 matmul's forms, for a GPU) on tiny shapes: every form
    runs and computes the engine's product (bfloat16 rounding apart)."""
    bench = BENCH.with_name("bench_int4.py")
    argv = [sys.executable, str(bench), "--layers", "2", "--hidden", "128", "--ffn", "256", "--calls", "1"]
    out = subprocess.run([*argv, "--repeats", "1", "--batches", "1", "3"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in out.stdout.splitlines() if re.match(r"\| \d", line)]
    assert {(r[0].strip(), r[1].strip()) for r in rows} == {
        (b, form) for b in ("1", "3") for form in ("bf16", "engine", "halves", "int4")
    }
    assert all(float(r[5]) < 0.02 for r in rows), out.stdout  # relative to the largest output
