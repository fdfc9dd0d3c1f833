"""JAX's persistent compilation cache goes where each engine's compilation_cache_dir says
(jaxinfer/worker/warm_up.py): "auto" is $JAXINFER_COMPILATION_CACHE_DIR, else ~/.cache/jaxinfer/xla; a
later engine naming another directory, or none, moves or stops the process's one cache."""

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxinfer import cli
from jaxinfer import llm as llm_module
from jaxinfer.config import EngineConfig
from jaxinfer.worker.warm_up import CACHE_DIR_VAR, compilation_cache_path, enable_compilation_cache


@pytest.fixture
def restore_cache():
    """The run's cache as it was (the suite shares one; tests/support/xla_env.py)."""
    before = jax.config.jax_compilation_cache_dir
    min_secs = jax.config.jax_persistent_cache_min_compile_time_secs
    yield
    enable_compilation_cache(before)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_secs)


def compile_one(directory, k: float) -> None:
    """Points the cache at `directory` as an engine would, then compiles a program no other test
    compiles (its constant `k`), small as it is: every compile is written."""
    enable_compilation_cache(directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.jit(lambda x: x * k + k).lower(jnp.ones(3)).compile()


def entries(directory: Path) -> set[str]:
    """The compiled programs a cache directory holds (with a size limit, JAX's LRU cache also
    keeps a `.lockfile` and an access time per program beside them)."""
    return {p.name for p in directory.iterdir() if p.name.endswith("-cache")}


def test_auto_reads_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_DIR_VAR, raising=False)
    assert compilation_cache_path("auto") == Path("~/.cache/jaxinfer/xla").expanduser()
    monkeypatch.setenv(CACHE_DIR_VAR, str(tmp_path))
    assert compilation_cache_path("auto") == tmp_path
    for off in ("", "none", "NONE"):
        monkeypatch.setenv(CACHE_DIR_VAR, off)
        assert compilation_cache_path("auto") is None
    assert compilation_cache_path(None) is None and compilation_cache_path("none") is None
    assert compilation_cache_path("~/elsewhere") == Path.home() / "elsewhere"


def test_each_engine_gets_the_directory_it_names(monkeypatch, tmp_path, restore_cache):
    first, second = tmp_path / "first", tmp_path / "second"
    compile_one(str(first), 1.25)
    assert entries(first)
    compile_one(str(second), 2.25)  # JAX alone would keep writing to the first directory
    written = entries(second)
    assert written and entries(first).isdisjoint(written)
    before = entries(first) | entries(second)
    compile_one(None, 3.25)  # off: nothing is written anywhere
    assert entries(first) | entries(second) == before
    monkeypatch.setenv(CACHE_DIR_VAR, str(first))
    held = entries(first)
    compile_one("auto", 4.25)
    assert entries(first) > held and entries(second) == written


def test_a_directory_that_cannot_be_one_is_refused_by_name(tmp_path, restore_cache):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"compilation_cache_dir='.*a-file/xla': cannot create"):
        enable_compilation_cache(str(blocker / "xla"))
    with pytest.raises(ValueError, match=r"compilation_cache_dir must be a directory, \"auto\" or None, got 3"):
        EngineConfig(compilation_cache_dir=3)


def test_the_cli_passes_the_directory_on(monkeypatch, capsys, tmp_path):
    seen = {}

    def fake_llm(*args, **kwargs):
        seen.update(kwargs)
        raise ValueError("stop before loading")

    monkeypatch.setattr(llm_module, "LLM", fake_llm)
    argv = ["generate", "hi", "--max-tokens", "1"]
    assert cli.main([*argv, "--compilation-cache-dir", str(tmp_path)]) == 2
    assert seen["compilation_cache_dir"] == str(tmp_path)
    assert cli.main(argv) == 2 and seen["compilation_cache_dir"] == "auto"
    assert "stop before loading" in capsys.readouterr().err
