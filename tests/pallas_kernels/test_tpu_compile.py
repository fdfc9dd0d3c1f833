"""The TPU kernels compiled for v5e, v6e and 7x on this machine, with no TPU: libtpu's
deviceless topologies run the whole XLA:TPU compiler, Mosaic's passes included (vector layouts,
DMAs, VMEM and SMEM allocation), which test_lowering.py cannot reach. Cases: tpu_compile.py.

The compiles run in one subprocess with libtpu on its path (tools/install.sh --test puts it in
.venv/tpu-compiler); without that folder the tests skip, saying so."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tpu_compile import CASES, FAILING, FAILING_WORDS
from xla_env import TPU_COMPILER, has_tpu_compiler, tpu_compiler_env

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.skipif(
    not has_tpu_compiler(), reason=f"libtpu not installed in {TPU_COMPILER} (tools/install.sh --test)"
)


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    proc = subprocess.run(
        [sys.executable, str(HERE / "tpu_compile.py")],
        capture_output=True,
        text=True,
        timeout=1200,
        env=tpu_compiler_env(),
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            results[r["case"]] = r
    assert results, f"tpu_compile.py printed nothing ({proc.returncode}):\n{proc.stderr[-3000:]}"
    return results


@pytest.mark.parametrize("case", sorted(CASES))
def test_tpu_kernel_compiles_for_the_chip(compiled, case):
    r = compiled[case]
    assert r["device_kind"].startswith(("TPU v5 lite", "TPU v6 lite", "TPU7x")), r
    assert r["ok"], r["error"]


@pytest.mark.parametrize("case", sorted(FAILING))
def test_the_compile_check_has_teeth(compiled, case):
    """Blocks that need more VMEM than the limit they ask for, a page table past SMEM: Mosaic's
    allocator, which only a real TPU compile runs, must reject them."""
    r = compiled[case]
    assert not r["ok"] and FAILING_WORDS[case] in r["error"], r
