"""The repository's layout rules, enforced: import contracts (import-linter, configured in
pyproject.toml), host-side packages free of JAX, and the size limits of docs/design/architecture.md."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxinfer", "serving", "pallas_kernels", "sharding", "checkpoints")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
MAX_FILE_LINES = 300
MAX_FUNCTION_LINES = 60
KERNEL_BODIES = {
    ("pallas_kernels/gpu_kernel.py", "attention_kernel"),
    ("pallas_kernels/tpu_ragged.py", "_attention_kernel"),
    ("pallas_kernels/tpu_decode.py", "_decode_kernel"),
}
GENERATED = ("_pb2.py", "_pb2_grpc.py")


def lint_imports(root: Path, *contracts: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}  # the copy under test wins
    only = [arg for c in contracts for arg in ("--contract", c)]
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(root / "pyproject.toml"), *only],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_import_contracts_are_kept():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "9 kept, 0 broken" in result.stdout


# (file to edit, line appended, the contract it must break)
BREAKAGES = {
    "core imports jax": ("jaxinfer/core/plan.py", "import jax", "host-side"),
    "kv imports jax": ("jaxinfer/kv/page_pool.py", "import jax", "host-side"),
    "kv imports the scheduler": ("jaxinfer/kv/manager.py", "import jaxinfer.core.scheduler", "jaxinfer-layers"),
    "tokenizer imports flax through a chain": (
        "jaxinfer/tokenizer/base.py",
        "import jaxinfer.models.layers",
        "host-side",
    ),
    "a kernel imports the engine": ("pallas_kernels/common.py", "import jaxinfer.engine", "packages"),
    "checkpoints import sharding": ("checkpoints/errors.py", "import sharding", "packages"),
    "jaxinfer imports serving": ("jaxinfer/llm.py", "import serving.server", "packages"),
    "the worker imports the engine": ("jaxinfer/worker/worker.py", "import jaxinfer.engine", "jaxinfer-layers"),
    "a cycle between siblings": ("jaxinfer/tokenizer/gguf_vocab.py", "import jaxinfer.tokenizer.load", "acyclic"),
    "the HTTP API imports protobuf": (
        "serving/openai/sse.py",
        "from google.protobuf import json_format",
        "openai-without-grpc",
    ),
    "a module both transports share imports one": (
        "serving/limits.py",
        "import serving.openai.errors",
        "serving-layers",
    ),
}


@pytest.mark.parametrize("case", sorted(BREAKAGES))
def test_import_contracts_fail_when_broken(case, tmp_path):
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    file, line, contract = BREAKAGES[case]
    with open(tmp_path / file, "a") as f:
        f.write(f"\n{line}  # noqa\n")
    assert lint_imports(tmp_path).returncode != 0
    result = lint_imports(tmp_path, contract)  # the contract this breakage is about
    assert result.returncode != 0 and "1 broken" in result.stdout, result.stdout


def _layered(contract: dict) -> set[str]:
    return {name.strip() for layer in contract["layers"] for name in layer.split("|")}


def test_every_module_is_in_a_layers_contract():
    """Each module and package directly inside jaxinfer/ and serving/ (and inside the packages
    that have layers of their own) is named by its container's layers contract: a new module must
    take a place in the import order."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layered = [
        (container, _layered(c)) for c in config if c["type"] == "layers" for container in c.get("containers", [])
    ]
    assert {"jaxinfer", "serving", "jaxinfer.worker", "jaxinfer.core", "jaxinfer.kv"} <= {c for c, _ in layered}
    for container, names in layered:
        folder = ROOT / container.replace(".", "/")
        children = {p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "__main__")}
        children |= {p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
        assert children == names, f"{container}: unplaced {sorted(children - names)}, gone {sorted(names - children)}"


def test_host_side_packages_do_not_import_jax():
    """jaxinfer.core, jaxinfer.kv, jaxinfer.tokenizer and jaxinfer.sampling.params are host-only: a fresh
    interpreter that imports them (and everything they import) has not loaded JAX."""
    code = (
        "import sys, jaxinfer.core, jaxinfer.core.scheduler, jaxinfer.kv, jaxinfer.tokenizer, "
        "jaxinfer.sampling.params; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _library_files() -> list[Path]:
    return [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py")) if not p.name.endswith(GENERATED)]


def test_library_files_fit_a_screen_or_three():
    too_long = {
        str(p.relative_to(ROOT)): n for p in _library_files() if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not too_long, f"files over {MAX_FILE_LINES} lines: {too_long}"


def test_functions_fit_a_screen():
    too_long = {}
    for path in _library_files():
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (rel, node.name) not in KERNEL_BODIES:
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    too_long[f"{rel}:{node.lineno} {node.name}"] = lines
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines: {too_long}"


# What a fresh clone holds is all it may cite: the design lives in docs/design/, not beside the
# repository. The needle is built so that this file does not match itself.
OUTSIDE = "../" + "shared"
CITING = (*PACKAGES, "tests", "benchmarks", "tools", "deploy", "docs", ".ci")


def test_no_file_points_outside_the_repository():
    files = [ROOT / "README.md", ROOT / "pyproject.toml"]
    files += [p for top in CITING for p in (ROOT / top).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    citing = []
    for path in files:
        try:
            text = path.read_text()
        except UnicodeDecodeError:  # golden arrays, GGUF fixtures
            continue
        if OUTSIDE in text:
            citing.append(str(path.relative_to(ROOT)))
    assert (ROOT / "docs" / "design" / "architecture.md").is_file()
    assert not citing, f"files that cite {OUTSIDE}/, outside the repository: {citing}"
