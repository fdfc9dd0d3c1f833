"""Shared test set-up: makes the helper modules in tests/support importable from any test, sets
the suite's XLA flags before jax starts and one compilation cache for the run
(tests/support/xla_env.py), sends the tests to
pytest-xdist workers module by module (README: the test command), and frees each module's
compiled programs."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "support"))

import compile_report  # noqa: E402
from testpaths import FIXTURES, TESTS, sentencepiece_model_path, smollm2_gguf_path  # noqa: E402,F401
from xla_env import apply_suite_flags, share_compilation_cache  # noqa: E402

apply_suite_flags()
_RUN_CACHE = share_compilation_cache()  # made here; a fresh one is removed when the run ends


def pytest_addoption(parser):
    parser.addoption(
        "--kernels",
        choices=("auto", "interpret", "compiled"),
        default=None,
        help="how the Pallas kernel tests run: compiled on the present accelerator, "
        "in interpret mode, or auto (compiled where the kernel's platform is the backend); "
        "default from JAXINFER_KERNELS, else auto",
    )
    compile_report.add_option(parser)


def pytest_unconfigure(config):
    if _RUN_CACHE:
        import shutil

        shutil.rmtree(_RUN_CACHE, ignore_errors=True)


def pytest_configure(config):
    import os

    mode = config.getoption("--kernels") or os.environ.get("JAXINFER_KERNELS", "auto")
    os.environ["JAXINFER_KERNELS"] = mode  # read by tests/pallas_kernels (kernel_mode.py)
    compile_report.configure(config)


# Tests that start processes of 8 forced CPU devices each: one worker runs them all under xdist.
DEVICE_PROCESS_MODULES = ("tests/sharding/", "tests/jaxinfer/test_kv_quant_sharded.py")
DEVICE_PROCESS_GROUP = "device-processes"
# Tests that start a local Ray cluster (tests/support/ray_support.py): one worker runs them in turn.
RAY_MODULES = ("tests/jaxinfer/integrations/", "tests/serving/test_ray_serve.py")


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to under xdist: its module, or the one group of the
    modules that start 8-device processes, or the one of the modules that start Ray clusters."""
    path = nodeid.split("::")[0]
    if path.startswith(RAY_MODULES):
        return "ray"
    return DEVICE_PROCESS_GROUP if path.startswith(DEVICE_PROCESS_MODULES) else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under `pytest -n N --dist loadgroup` each module is one unit of work (`work_unit`), so
    its module- and package-scoped fixtures (engines, servers) are built once, not once per
    worker, and two 8-device processes never run at once. The units go out in xdist's order (most
    tests first), the device-process group before all (it runs longest), so it does not start last.

    A scheduler of our own rather than `xdist_group` markers: pytest-xdist 3.8 applies those by
    renaming each item's `_nodeid`, which pytest 9.2's nodes no longer read, so every test was
    sent out on its own and both workers built each module's engines."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def _assign_work_unit(self, node) -> None:
            if DEVICE_PROCESS_GROUP in self.workqueue:  # the queue is built; put the group first
                self.workqueue.move_to_end(DEVICE_PROCESS_GROUP, last=False)
            super()._assign_work_unit(node)

    return ModuleScheduling(config, log)


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
