"""Where the suite's time goes: JAX's tracing, lowering and XLA compile seconds, per test.

    pytest -n 2 --dist loadgroup tests --compile-report DIR   # each worker writes DIR/<worker id>.json
    python tests/support/compile_report.py DIR [ROWS]         # the table, by module

JAX reports each trace, lowering and backend compile through `jax.monitoring`; the listener
charges them to the test running in that process (a module fixture's to its first test).
Compiles run on threads side by side can add up to more than the test's wall time. Work done in
processes a test starts (servers, CLI runs, 8-device scenarios, TPU compiles) is not seen: those
tests show wall time and no compiles."""

from __future__ import annotations

import collections
import json
import sys
import time
from pathlib import Path

import pytest

EVENTS = {
    "/jax/core/compile/backend_compile_duration": "compile",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache_read",
}
COLUMNS = ("wall", "compile", "lower", "trace", "cache_read", "compiles")


def add_option(parser) -> None:
    parser.addoption(
        "--compile-report",
        metavar="DIR",
        default=None,
        help="write each process's JAX trace / lowering / compile seconds per test to "
        "DIR (tests/support/compile_report.py DIR prints them by module)",
    )


def configure(config) -> None:
    if directory := config.getoption("--compile-report"):
        worker = getattr(config, "workerinput", {}).get("workerid", "main")  # an xdist worker's id
        config.pluginmanager.register(CompileReport(Path(directory) / f"{worker}.json"), "compile-report")


class CompileReport:
    def __init__(self, path: Path):
        self.path = path
        self.current = "<outside tests>"
        self.tests: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def listen(self, event: str, seconds: float, **_) -> None:
        if (column := EVENTS.get(event)) is not None:
            self.tests[self.current][column] += seconds
            if column == "compile":
                self.tests[self.current]["compiles"] += 1

    def pytest_configure(self, config):
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self.listen)

    def pytest_unconfigure(self, config):
        import jax.monitoring

        jax.monitoring.unregister_event_duration_listener(self.listen)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.current, start = item.nodeid, time.perf_counter()
        yield
        self.tests[item.nodeid]["wall"] += time.perf_counter() - start
        self.current = "<between tests>"

    def pytest_sessionfinish(self, session):
        if not self.tests:  # xdist's controller runs none
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.tests))


def table(directory: str, rows: int = 40) -> str:
    modules: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for file in sorted(Path(directory).glob("*.json")):
        for test, counts in json.loads(file.read_text()).items():
            modules[test.split("::")[0]].update(counts)
    total = sum(modules.values(), collections.Counter())
    lines = ["| module | " + " | ".join(COLUMNS) + " |", "|---|" + "---|" * len(COLUMNS)]
    for name, counts in [("(all)", total), *sorted(modules.items(), key=lambda m: -m[1]["wall"])[:rows]]:
        cells = [f"{counts[c]:.0f}" if c == "compiles" else f"{counts[c]:.1f}" for c in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or not Path(sys.argv[1]).is_dir():
        sys.exit(f"usage: {sys.argv[0]} DIR [ROWS]  (DIR: what --compile-report wrote)")
    print(table(sys.argv[1], int(sys.argv[2]) if len(sys.argv) == 3 else 40))
