"""`pytest --compile-report DIR` (tests/support/compile_report.py): each process's JAX compile
seconds charged to the test that compiled, and the table by module. Checked on a toy suite run
the way the test command runs (two xdist workers), in a subprocess."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")

SUPPORT = Path(__file__).resolve().parent / "support"

TOY_CONFTEST = f"""
import sys
sys.path.insert(0, {str(SUPPORT)!r})
import compile_report

def pytest_addoption(parser):
    compile_report.add_option(parser)

def pytest_configure(config):
    compile_report.configure(config)
"""

TOY_TESTS = {
    "test_jits.py": """
import jax
X = jax.ShapeDtypeStruct((3,), "float32")  # no array made: nothing else compiles

def test_two_programs():
    jax.jit(lambda x: x * 2).lower(X).compile()
    jax.jit(lambda x: x + 1).lower(X).compile()

def test_nothing():
    pass
""",
    "test_more.py": """
import jax, jax.numpy as jnp

def test_one_program():
    jax.jit(jnp.sin).lower(jax.ShapeDtypeStruct((4,), "float32")).compile()
""",
}


def test_compiles_are_charged_to_their_test_and_tabled_by_module(tmp_path):
    (tmp_path / "conftest.py").write_text(TOY_CONFTEST)
    for name, text in TOY_TESTS.items():
        (tmp_path / name).write_text(text)
    report = tmp_path / "report"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # this run's xdist ids
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "2",
            "-p",
            "no:cacheprovider",
            "--compile-report",
            str(report),
            ".",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert all(f.name.startswith("gw") for f in report.iterdir()), list(report.iterdir())  # none from the controller
    tests = {}
    for file in report.glob("gw*.json"):
        tests.update(json.loads(file.read_text()))
    assert tests["test_jits.py::test_two_programs"]["compiles"] == 2, tests
    assert tests["test_more.py::test_one_program"]["compiles"] == 1, tests
    assert "compiles" not in tests["test_jits.py::test_nothing"], tests
    for name in ("test_jits.py::test_two_programs", "test_more.py::test_one_program"):
        counts = tests[name]
        assert 0 < counts["compile"] and 0 < counts["lower"] and counts["wall"] > 0, counts

    table = subprocess.run(
        [sys.executable, str(SUPPORT / "compile_report.py"), str(report)], capture_output=True, text=True, check=True
    ).stdout
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in table.splitlines()[2:]}
    assert set(rows) == {"(all)", "test_jits.py", "test_more.py"}, table
    assert [int(rows[m][-1]) for m in ("(all)", "test_jits.py", "test_more.py")] == [3, 2, 1], table


def test_the_table_names_a_missing_report(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SUPPORT / "compile_report.py"), str(tmp_path / "nope")], capture_output=True, text=True
    )
    assert proc.returncode != 0 and "usage:" in proc.stderr and "--compile-report" in proc.stderr
