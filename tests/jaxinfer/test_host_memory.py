"""Host heap reuse on the CPU (jaxinfer/worker/host_memory.py): what it changes, when it stays off."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from model_harness import small_cpu_worker
from testpaths import FIXTURES

from jaxinfer.config import ModelConfig
from jaxinfer.loader import LoadedModel
from jaxinfer.models.registry import get_family
from jaxinfer.worker import host_memory

# Page faults of writing a freshly allocated 64 MiB block after a block of that size was freed:
# glibc's default unmaps it on free (one fault per page written again); with the heap kept, the
# same pages come back.
PROBE = r"""
import ctypes, json, resource
from jaxinfer.worker import host_memory

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 64 << 20

def faults_of_a_fresh_block():  # as XLA's buffers: malloc'd, written, freed (no madvise)
    libc.free(ctypes.memset(libc.malloc(SIZE), 1, SIZE))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    libc.free(ctypes.memset(libc.malloc(SIZE), 1, SIZE))
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

default = faults_of_a_fresh_block()
applied = host_memory.reuse_freed_heap()
print(json.dumps({"default": default, "applied": applied, "kept": faults_of_a_fresh_block()}))
"""

glibc = pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"), reason="the C library is not glibc")


def _probe(**env) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        check=True,
        env={**clean, **env},
        cwd=Path(__file__).resolve().parents[2],
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _huge_pages_always() -> bool:  # the kernel then backs big blocks with 2 MiB pages: few faults anyway
    try:
        return "[always]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


@glibc
def test_a_freed_block_comes_back_without_page_faults():
    pages = (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    got = _probe()
    assert got["applied"] is True
    if not _huge_pages_always():
        assert got["default"] > pages // 2, got  # the default: every page faults again
    assert got["kept"] < pages // 20, got


@glibc
def test_an_allocator_the_user_chose_is_left_alone(monkeypatch):
    pages = (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    got = _probe(MALLOC_TRIM_THRESHOLD_="131072")
    assert got["applied"] is False
    if not _huge_pages_always():
        assert got["kept"] > pages // 2, got
    for name in host_memory._USER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert "MALLOC_TRIM_THRESHOLD_" in host_memory._left_alone()
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libtcmalloc_minimal.so.4")
    assert "LD_PRELOAD" in host_memory._left_alone()


CONFIG = ModelConfig(
    model_type="llama",
    family="llama",
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=64,
)


@pytest.mark.parametrize("reuse", [True, False])
def test_the_cpu_runner_applies_it_unless_configured_off(monkeypatch, reuse):
    calls = []
    monkeypatch.setattr("jaxinfer.worker.device_state.reuse_freed_heap", lambda: calls.append(1) or True)
    family = get_family("llama")
    model = LoadedModel(CONFIG, family.init_params(CONFIG, jax.random.key(0)), None, family, Path("random"))
    small_cpu_worker(model, cpu_heap_reuse=reuse)
    assert calls == ([1] if reuse else [])


@pytest.mark.parametrize("flags,reuse", [([], True), (["--no-cpu-heap-reuse"], False)])
def test_the_serve_flag_reaches_the_runner(monkeypatch, flags, reuse):
    """`jaxinfer serve --no-cpu-heap-reuse` (make_llm) leaves the allocator alone."""
    from jaxinfer import cli
    from jaxinfer.cli.args import make_llm

    calls = []
    monkeypatch.setattr("jaxinfer.worker.device_state.reuse_freed_heap", lambda: calls.append(1) or True)
    args = cli.build_parser().parse_args(
        [
            "serve",
            "--model",
            str(FIXTURES / "hf" / "llama3"),
            "--dtype",
            "float32",
            "--num-pages",
            "8",
            "--max-model-len",
            "64",
            "--token-buckets",
            "8,512",
            *flags,
        ]
    )
    engine = make_llm(args, warm_up=False).engine
    assert engine.config.compile.cpu_heap_reuse is reuse and calls == ([1] if reuse else [])
