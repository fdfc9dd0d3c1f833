"""The XLA flags the test suite runs under, and the environment of the processes tests start.

On a machine without an accelerator the suite asks XLA:CPU for unoptimised machine code
(`--xla_backend_optimization_level=0`): most of the suite's time is compiling small programs
that then run for milliseconds, and LLVM's optimisation passes were a third of each compile.
The optimised HLO is the same at every level (checked on the engine's step variants: one-token,
8-token and a 4-step decode window compiled to identical text); only the LLVM passes that turn
it into machine code are skipped, so what the tests check of compiled programs still holds.
Numerics may move by rounding: the fp8-cache comparison in test_kv_quant.py, already an xfail on
some CPUs, is one there. Benchmarks
and the engine itself are not affected: the flag lives only in the test processes' environment.
`JAXINFER_TEST_XLA_OPT=1` keeps XLA's default level (to run the suite as production compiles)."""

import os
import shutil
import tempfile
from pathlib import Path

SUITE_FLAGS_VAR = "JAXINFER_TEST_XLA_FLAGS"
FAST_CPU_FLAGS = "--xla_backend_optimization_level=0"
ACCELERATOR_DEVICES = ("/dev/nvidia0", "/dev/accel0", "/dev/vfio/0")


def _has_accelerator() -> bool:
    if os.environ.get("JAX_PLATFORMS", "").strip() == "cpu":
        return False
    return any(Path(p).exists() for p in ACCELERATOR_DEVICES)


def suite_flags() -> str:
    """The flags the suite adds to XLA_FLAGS: fast CPU compiles unless an accelerator is present
    or JAXINFER_TEST_XLA_OPT=1."""
    if os.environ.get("JAXINFER_TEST_XLA_OPT") == "1" or _has_accelerator():
        return ""
    return FAST_CPU_FLAGS


def apply_suite_flags() -> None:
    """Adds the suite's flags to this process's XLA_FLAGS (before jax starts its backends) and
    records them for `child_env`. Called once, from tests/conftest.py."""
    flags = os.environ.setdefault(SUITE_FLAGS_VAR, suite_flags())
    if flags and flags not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()


# The suite's compilation cache, kept between runs (apart from the engine's own ~/.cache/jaxinfer/xla),
# and the most it may hold: JAX evicts the least recently used programs past it.
SUITE_CACHE = Path("~/.cache/jaxinfer/test-xla").expanduser()
SUITE_CACHE_BYTES = 4 << 30
FRESH_CACHE_VAR = "JAXINFER_TEST_FRESH_CACHE"
SUITE_GGUF_INDEX = Path("~/.cache/jaxinfer/test-gguf").expanduser()
SUITE_GGUF_INDEXES = 2000


def share_compilation_cache() -> str | None:
    """One persistent compilation cache for the run: every engine the tests build with the
    default compilation_cache_dir ("auto"), in the xdist workers and in the processes tests
    start (servers, CLI runs), reads and writes this directory, so a step compiled once is read
    back everywhere else. It is kept between runs: a machine that ran the suite before reads back
    every program whose code did not change (JAX keys each by its HLO, compile options, XLA flags
    and jax version); a clean machine compiles them all. Returns the directory to remove when the
    run ends, if any: with JAXINFER_TEST_FRESH_CACHE=1 the run gets one of its own, as a clean
    machine would. A directory already set is used as it is."""
    from jaxinfer.config.compile import CACHE_DIR_VAR, EXECUTABLES_DIR_VAR

    # The step goes through the jit in the suite: the executable store is keyed by the code's
    # version, so after every edit it would compile each variant afresh, where JAX's cache (keyed
    # by HLO) still has it; tests/jaxinfer/test_executables.py passes a directory of its own.
    os.environ.setdefault(EXECUTABLES_DIR_VAR, "none")
    # Parsed GGUF metadata (checkpoints/gguf_io.py) in a directory of the suite's own: tests write
    # GGUF files under fresh temporary paths, one index each; past SUITE_GGUF_INDEXES it starts over.
    if not os.environ.get("JAXINFER_GGUF_INDEX_DIR"):
        SUITE_GGUF_INDEX.mkdir(parents=True, exist_ok=True)
        if sum(1 for _ in SUITE_GGUF_INDEX.iterdir()) > SUITE_GGUF_INDEXES:
            shutil.rmtree(SUITE_GGUF_INDEX, ignore_errors=True)
            SUITE_GGUF_INDEX.mkdir(parents=True, exist_ok=True)
        os.environ["JAXINFER_GGUF_INDEX_DIR"] = str(SUITE_GGUF_INDEX)
    if os.environ.get(CACHE_DIR_VAR):
        return None
    fresh = os.environ.get(FRESH_CACHE_VAR) == "1"
    if fresh:
        os.environ[CACHE_DIR_VAR] = tempfile.mkdtemp(prefix="jaxinfer-test-xla-")
    else:
        SUITE_CACHE.mkdir(parents=True, exist_ok=True)
        os.environ[CACHE_DIR_VAR] = str(SUITE_CACHE)
    # Every process of the run, not only those that build engines, compiles through it (the
    # kernel tests' programs too), as an engine would: programs that took 0.5 s and more.
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ[CACHE_DIR_VAR])
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(SUITE_CACHE_BYTES))
    return os.environ[CACHE_DIR_VAR] if fresh else None


# libtpu for compiling TPU programs on this machine (tools/install.sh --test), off the venv's path.
TPU_COMPILER = Path(__file__).resolve().parents[2] / ".venv" / "tpu-compiler"


def tpu_compiler_env() -> dict:
    """`child_env` for a process that compiles for TPU chips without one: libtpu on its path,
    JAX's own backend the CPU, libtpu's start-up chatter quiet, and its one-process lock
    (/tmp/libtpu_lockfile) off, since two xdist workers may compile for TPUs at once."""
    path = os.pathsep.join([str(TPU_COMPILER), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return child_env(
        JAX_PLATFORMS="cpu",
        PYTHONPATH=path,
        TPU_ACCELERATOR_TYPE="v5litepod-1",
        TF_CPP_MIN_LOG_LEVEL="2",
        ALLOW_MULTIPLE_LIBTPU_LOAD="1",
    )


def has_tpu_compiler() -> bool:
    return (TPU_COMPILER / "libtpu").is_dir()


def child_env(devices: int | None = None, drop: tuple[str, ...] = (), **extra: str) -> dict:
    """The environment for a process a test starts: this one's, with XLA_FLAGS reset to the
    suite's flags plus `devices` forced host CPU devices (a parent's own device count never leaks
    into a child), without the variables in `drop`, and with `extra` set."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    flags = os.environ.get(SUITE_FLAGS_VAR, "")
    if devices:
        flags = f"{flags} --xla_force_host_platform_device_count={devices}"
    env["XLA_FLAGS"] = flags.strip()
    env.update(extra)
    return env
