"""The test command's xdist scheduling (tests/conftest.py): under `-n 2 --dist loadgroup` every
test module runs on one worker, and the modules that start 8-device processes all run on one
worker, before the others. Checked on a toy suite in a subprocess, so a pytest or pytest-xdist
upgrade that quietly spreads a module over both workers again fails here."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")

CONFTEST = Path(__file__).resolve().parent / "conftest.py"

TOY_CONFTEST = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("suite_conftest", {str(CONFTEST)!r})
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)
pytest_xdist_make_scheduler = suite.pytest_xdist_make_scheduler
"""

TOY_TEST = """
import pytest

@pytest.mark.parametrize("i", range(6))
def test_case(i):
    pass
"""

MODULES = [
    "tests/jaxinfer/test_a.py",
    "tests/jaxinfer/test_b.py",
    "tests/serving/test_c.py",
    "tests/jaxinfer/test_kv_quant_sharded.py",
    "tests/sharding/test_d.py",
    "tests/sharding/test_e.py",
]
DEVICE_GROUP = {"tests/jaxinfer/test_kv_quant_sharded.py", "tests/sharding/test_d.py", "tests/sharding/test_e.py"}


def test_each_module_runs_on_one_worker_and_device_processes_share_one(tmp_path):
    (tmp_path / "conftest.py").write_text(TOY_CONFTEST)
    for module in MODULES:
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / module).write_text(TOY_TEST)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider", "tests"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ran = re.findall(r"\[(gw\d)\].*?PASSED (tests/\S+\.py)::", proc.stdout)
    assert len(ran) == 6 * len(MODULES), proc.stdout[-3000:]
    workers: dict[str, set[str]] = {}
    for worker, module in ran:
        workers.setdefault(module, set()).add(worker)
    assert all(len(found) == 1 for found in workers.values()), workers
    device_workers = set().union(*(workers[m] for m in DEVICE_GROUP))
    assert len(device_workers) == 1, workers
    # The device-process group goes out first: its worker's first test is one of the group's.
    (device_worker,) = device_workers
    first = next(module for worker, module in ran if worker == device_worker)
    assert first in DEVICE_GROUP, ran
