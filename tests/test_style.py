"""The field's habits, held by tools: ruff's lint and format check over the tree, mypy over the
packages, and an annotation on every public function of the packages (their parameters and
return). Configured in pyproject.toml; .pre-commit-config.yaml runs the same before a commit."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxinfer", "serving", "pallas_kernels", "sharding", "checkpoints")
BIN = Path(sys.executable).parent
GENERATED = ("_pb2.py", "_pb2_grpc.py")


def tool(name: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / name), *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_ruff_lint_is_clean():
    result = tool("ruff", "check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_ruff_format_is_kept():
    result = tool("ruff", "format", "--check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_ruff_finds_what_it_is_configured_to(tmp_path):
    """The configuration selects the rules it names: a file breaking them fails both checks."""
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "bad.py").write_text("import os\nimport sys\ndef f(x = 1):\n    return x\n")
    assert "F401" in tool("ruff", "check", "--no-cache", ".", cwd=tmp_path).stdout
    assert tool("ruff", "format", "--check", "--no-cache", ".", cwd=tmp_path).returncode == 1


def test_mypy_is_clean(tmp_path):
    """mypy over the packages as pyproject.toml configures it (a fresh cache: ~40 s on 2 cores)."""
    result = tool("mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(tmp_path / "cache"))
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_mypy_finds_what_it_is_configured_to(tmp_path):
    """The configuration checks what it says it does: a wrong return type, a function with some
    parameters unannotated, an ignore that ignores nothing."""
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "serving" / "bad.py").write_text(
        "def f(x: int) -> str:\n    return x\n\n\n"
        "def g(x, y: int) -> None: ...\n\n\n"
        "z: int = 1  # type: ignore[assignment]\n"
    )
    result = tool("mypy", "--cache-dir", str(tmp_path / "cache"), cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    for code in ("[return-value]", "[no-untyped-def]", "[unused-ignore]"):
        assert code in result.stdout, result.stdout


def public_functions(tree: ast.Module):
    """(qualified name, def) of each module-level function and each method of a public class,
    that is not private (a leading underscore; __init__ counts as public)."""
    for node in tree.body:
        defs = [(node.name, node)] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else []
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            defs = [
                (f"{node.name}.{f.name}", f)
                for f in node.body
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            ]
        for name, fn in defs:
            if not fn.name.startswith("_") or fn.name == "__init__":
                yield name, fn


def unannotated(fn: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> list[str]:
    """The parameters (and "return") of `fn` that carry no annotation."""
    args = fn.args
    params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    if method and params and params[0].arg in ("self", "cls") and not _is_static(fn):
        params = params[1:]
    missing = [a.arg for a in params if a.annotation is None]
    missing += [f"*{a.arg}" for a in (args.vararg,) if a is not None and a.annotation is None]
    missing += [f"**{a.arg}" for a in (args.kwarg,) if a is not None and a.annotation is None]
    if fn.returns is None and fn.name != "__init__":
        missing.append("return")
    return missing


def _is_static(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)


def missing_annotations(source: str) -> dict[str, list[str]]:
    tree = ast.parse(source)
    return {name: m for name, fn in public_functions(tree) if (m := unannotated(fn, "." in name))}


def test_public_functions_are_annotated():
    missing = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if not path.name.endswith(GENERATED):
                for name, what in missing_annotations(path.read_text()).items():
                    missing[f"{path.relative_to(ROOT)}:{name}"] = what
    assert not missing, f"{len(missing)} public functions without annotations: {missing}"


@pytest.mark.parametrize(
    "source,found",
    [
        ("def f(x): return x", {"f": ["x", "return"]}),
        ("def f(x: int, *a, **k) -> int: return x", {"f": ["*a", "**k"]}),
        (
            "class C:\n    def m(self, y: int): ...\n    def _p(self, z): ...\n    def __init__(self, q): ...",
            {"C.m": ["return"], "C.__init__": ["q"]},
        ),
        ("class C:\n    @staticmethod\n    def s(a: int) -> int: ...", {}),
        ("def _private(x): ...\nclass _Hidden:\n    def m(self, y): ...", {}),
    ],
)
def test_the_annotation_check_reads_what_it_should(source, found):
    assert missing_annotations(source) == found
