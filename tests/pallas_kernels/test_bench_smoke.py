"""benchmarks/bench_attention.py --smoke: every code path (ceilings, correctness check, timing,
jax's paged_attention, the table) on tiny shapes with the kernels interpreted."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import jax

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_attention.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_attention", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    return bench


def test_bench_attention_smoke(capsys):
    load_bench().main(["--smoke"])
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    rows = table[1:]  # past the header (the |---| line does not start with "| ")
    impls = {row.split("|")[2].strip() for row in rows}
    assert {"pallas_gpu", "reference (XLA)"} <= impls
    assert len(rows) >= 8
    for row in rows:
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert cells[2], f"no time: {row}"
        assert "FAIL" not in row and not cells[-1], row


def test_bench_attention_tpu_smoke(capsys):
    """--kernel tpu: the TPU kernel as it ships (decode / mixed / prefill paths) and as one
    ragged call, checked against the reference and timed; jax's TPU kernel gets its row (it
    asks for a TPU version, so off a TPU the row reports that instead of a time)."""
    # The mixed scenario alone: its decodes and its chunk take two of the paths.
    load_bench().main(["--smoke", "--kernel", "tpu", "--scenarios", "mixed"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]  # past the header
    impls = [row.split("|")[2].strip() for row in rows]
    assert impls == ["pallas_tpu", "pallas_tpu one call", "reference (XLA)", "jax ops.tpu.ragged_paged_attention"]
    for row in rows:
        cells = [c.strip() for c in row.split("|")[1:-1]]
        if cells[1].startswith("jax ") and jax.default_backend() != "tpu":
            assert "TPU version" in cells[-1], row
            continue
        assert cells[2] and "FAIL" not in row and not cells[-1], row


def test_bench_attention_sweep_smoke(capsys):
    """--sweep: the default config's neighbours each run, check and time."""
    load_bench().main(["--smoke", "--sweep", "--scenarios", "prefill", "--skip-reference"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    swept = [row for row in rows if "bkv=" in row]
    assert len(swept) >= 5
    for row in swept:
        assert "FAIL" not in row and not row.split("|")[-2].strip(), row


def test_gpu_session_script_rejects_an_unknown_part(tmp_path):
    script = BENCH.parent / "gpu_session.sh"
    done = subprocess.run(["bash", str(script), "nope", str(tmp_path)], capture_output=True,
                          text=True, cwd=BENCH.parents[1])
    assert done.returncode == 2 and "unknown part: nope" in done.stderr
