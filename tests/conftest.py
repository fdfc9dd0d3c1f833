"""Shared test set-up: makes the helper modules in tests/support importable from any test, groups
the tests for pytest-xdist (README: the test command), and frees each module's compiled programs."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "support"))

from testpaths import FIXTURES, TESTS, sentencepiece_model_path, smollm2_gguf_path  # noqa: E402,F401


def pytest_addoption(parser):
    parser.addoption(
        "--kernels", choices=("auto", "interpret", "compiled"),
        default=None, help="how the Pallas kernel tests run: compiled on the present accelerator, "
        "in interpret mode, or auto (compiled where the kernel's platform is the backend); "
        "default from JAXINFER_KERNELS, else auto")


def pytest_configure(config):
    import os
    mode = config.getoption("--kernels") or os.environ.get("JAXINFER_KERNELS", "auto")
    os.environ["JAXINFER_KERNELS"] = mode  # read by tests/pallas_kernels (kernel_mode.py)


# Tests that start processes of 8 forced CPU devices each: one worker runs them all under xdist.
DEVICE_PROCESS_MODULES = ("tests/sharding/", "tests/jaxinfer/test_kv_quant_sharded.py")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under `pytest -n N --dist loadgroup` each module is one unit of work, so its module- and
    package-scoped fixtures (engines, servers) are built once, not once per worker; the modules
    that start 8-device processes share one group, so two such processes never run at once."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if any(item.iter_markers("xdist_group")):
            continue
        path = item.nodeid.split("::")[0]
        group = "device-processes" if path.startswith(DEVICE_PROCESS_MODULES) else path
        item.add_marker(pytest.mark.xdist_group(group))


# Packages whose engines outlive a module (a package-scoped fixture): their compiled programs
# are kept between the package's modules, or the shared engine would compile again after its
# warm-up (tests/serving's `tiny_llm`, whose server reports its compiled variants).
SHARED_ENGINE_PACKAGES = ("tests/serving/",)


@pytest.fixture(scope="module", autouse=True)
def _release_module_programs(request):
    """Frees what a module compiled once it is done: each module builds its own engines, so a
    worker that keeps every module's executables grows by gigabytes over the suite."""
    yield
    import gc

    import jax
    gc.collect()
    if not request.node.nodeid.startswith(SHARED_ENGINE_PACKAGES):
        jax.clear_caches()
