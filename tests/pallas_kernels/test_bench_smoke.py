"""benchmarks/bench_attention.py --smoke: every code path (ceilings, correctness check, timing,
jax's paged_attention, the table) on tiny shapes with the kernels interpreted."""
import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_attention.py"


def test_bench_attention_smoke(capsys):
    spec = importlib.util.spec_from_file_location("bench_attention", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    bench.main(["--smoke"])
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    rows = table[2:]
    impls = {row.split("|")[2].strip() for row in rows}
    assert {"pallas_gpu", "reference (XLA)"} <= impls
    assert len(rows) >= 8
    for row in rows:
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert cells[2], f"no time: {row}"
        assert "FAIL" not in row and not cells[-1], row
