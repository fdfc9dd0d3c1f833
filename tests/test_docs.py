"""The documentation site builds with `mkdocs build --strict` (mkdocs.yml): every page in the nav
exists, no page is left out of it, and no link or anchor is broken. A broken copy shows the build
fails where it should."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MKDOCS = Path(sys.executable).with_name("mkdocs")


def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [str(MKDOCS), "build", "--strict", "--config-file", str(root / "mkdocs.yml"), "--site-dir", str(site)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The repository's site, built once for the tests that read it."""
    out = tmp_path_factory.mktemp("docs") / "site"
    done = build(ROOT, out)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_the_site_builds_strictly(site):
    for page in ("index.html", "design/architecture/index.html", "guides/monitoring/index.html"):
        assert (site / page).is_file(), page


def copy_of_the_docs(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", root / "docs")
    shutil.copy(ROOT / "mkdocs.yml", root)
    (root / "tools").mkdir()
    shutil.copy(ROOT / "tools" / "docs_hooks.py", root / "tools")
    return root


def test_a_broken_link_fails_the_build(tmp_path):
    root = copy_of_the_docs(tmp_path)
    with (root / "docs" / "index.md").open("a") as f:
        f.write("\nSee [the missing page](guides/missing.md).\n")
    done = build(root, tmp_path / "site")
    assert done.returncode != 0 and "missing.md" in done.stderr


def test_a_page_left_out_of_the_nav_fails_the_build(tmp_path):
    root = copy_of_the_docs(tmp_path)
    (root / "docs" / "guides" / "orphan.md").write_text("# Orphan\n")
    done = build(root, tmp_path / "site")
    assert done.returncode != 0 and "orphan.md" in done.stderr


def page_text(site: Path, page: str) -> str:
    """A built page's text, tags stripped and entities decoded."""
    import html
    import re

    return html.unescape(re.sub(r"<[^>]+>", " ", (site / page / "index.html").read_text()))


def test_every_flag_option_route_and_call_is_in_the_reference(site):
    from jaxinfer.config import EngineConfig
    from jaxinfer.options import declared
    from jaxinfer.sampling.params import SamplingParams
    from serving.grpc.proto import jaxinfer_pb2
    from serving.openai.schema import LORA_OPERATIONS, OPERATIONS
    from tests.support.cli_surface import surface

    cli, options = page_text(site, "reference/cli"), page_text(site, "reference/options")
    missing = [
        f"{command} {flag}"
        for command, spec in surface().items()
        for key in spec["flags"]
        for flag in key.split("/")
        if flag.startswith("-") and flag not in cli
    ]
    assert not missing, f"flags missing from docs/reference/cli.md: {missing}"
    assert "## `jaxinfer serve`" not in cli  # the headings were rendered, not left as markdown
    names = [d.name for _, d in EngineConfig.declared()] + [d.name for d in declared(SamplingParams)]
    assert not [n for n in names if n not in options], "options missing from docs/reference/options.md"
    http = page_text(site, "reference/http")
    routes = [
        f"{op.method.upper()} {op.path}" for op in OPERATIONS + LORA_OPERATIONS
    ]  # every route (tests/serving/openai/test_schema.py)
    assert not [r for r in routes if r not in http], "routes missing from docs/reference/http.md"
    grpc = page_text(site, "reference/grpc")
    service = jaxinfer_pb2.DESCRIPTOR.services_by_name["InferenceService"]
    names = [m.name for m in service.methods] + list(jaxinfer_pb2.DESCRIPTOR.message_types_by_name)
    assert not [n for n in names if n not in grpc], "calls or messages missing from docs/reference/grpc.md"


def results_section(title: str) -> str:
    """The text of one `## title` entry of benchmarks/RESULTS.md."""
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def test_the_headline_figures_are_the_logged_ones_and_plot(tmp_path):
    import json
    import re

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plot_headline

    data = json.loads((ROOT / "benchmarks" / "headline.json").read_text())
    for name in plot_headline.PLOTS:
        group = data[name]
        logged = {float(n.replace(",", "")) for n in re.findall(r"\d[\d,]*\.?\d*", results_section(group["entry"]))}
        for row in group["rows"]:
            for key, value in row.items():
                if isinstance(value, float):
                    assert value in logged, f"{name}: {key}={value} is not in RESULTS.md's entry {group['entry']!r}"
    written = plot_headline.main(["--out", str(tmp_path)])
    assert sorted(p.name for p in written) == sorted(f"{name}.png" for name in plot_headline.PLOTS)
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (ROOT / "docs" / "assets" / path.name).is_file(), f"{path.name} is not committed under docs/assets"


def test_a_design_page_shows_the_module_docstrings_it_names(site):
    import ast

    text = " ".join(page_text(site, "design/kv-cache-manager").split())
    doc = ast.get_docstring(ast.parse((ROOT / "jaxinfer" / "kv" / "manager.py").read_text()))
    assert " ".join(doc.split()[:30]) in text
    methods = page_text(site, "design/benchmark-methods")
    assert all(f"{p.name}" in methods for p in (ROOT / "benchmarks").glob("bench_*.py"))
