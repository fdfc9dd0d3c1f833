"""Prepared weights (jaxinfer.prepared_weights): a GGUF load kept and read back whole, refused
when damaged or made for another file or setting, and kept only where it should be."""

from __future__ import annotations

import logging
import os
import shutil

import jax
import numpy as np
import pytest

import jaxinfer.loader as loader
from jaxinfer.cli import info
from jaxinfer.config import EngineConfig
from jaxinfer.loader import load_model
from jaxinfer.quant import QuantConfig
from jaxinfer.worker.programs import weights_path
from sharding import DevicePlacer


def _same(a, b) -> None:
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and x.sharding == y.sharding
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _no_reading(monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("the checkpoint was read again")

    monkeypatch.setattr(loader, "load_params", fail)


@pytest.mark.parametrize(
    "dtype, quant",
    [("bfloat16", None), ("float32", None), ("float32", QuantConfig.parse("int8", None, False))],
    ids=["bf16", "f32", "int8"],
)
def test_a_second_load_reads_the_prepared_weights(tmp_path, monkeypatch, dtype, quant):
    first = load_model(None, dtype, quantization=quant, prepared_dir=tmp_path)
    (entry,) = tmp_path.glob("*.safetensors")
    _no_reading(monkeypatch)
    again = load_model(None, dtype, quantization=quant, prepared_dir=tmp_path)
    _same(first.params, again.params)
    assert again.tokenizer.encode("Paris") == first.tokenizer.encode("Paris")
    assert (again.config, again.quantization) == (first.config, first.quantization)
    assert list(tmp_path.glob("*.safetensors")) == [entry]
    # Kept in the layout one CPU device's step computes with: the engine has nothing to convert.
    if dtype == "float32" and quant is None:
        assert type(again.params.layers[0].w_qkv).__name__ == "OutFirstWeight"
    relaid = again.family.compute_layout(again.params, None)
    assert all(a is b for a, b in zip(jax.tree.leaves(relaid), jax.tree.leaves(again.params), strict=True))


def test_a_damaged_or_foreign_entry_is_refused_and_written_again(tmp_path, monkeypatch, caplog):
    first = load_model(None, "bfloat16", prepared_dir=tmp_path)
    (entry,) = tmp_path.glob("*.safetensors")
    size = entry.stat().st_size
    with open(entry, "r+b") as f:
        f.truncate(size // 2)
    with caplog.at_level(logging.WARNING, logger="jaxinfer.prepared_weights"):
        again = load_model(None, "bfloat16", prepared_dir=tmp_path)
    assert "not used" in caplog.text and str(entry) in caplog.text
    _same(first.params, again.params)
    assert entry.stat().st_size == size  # written whole again
    # Another setting is another entry; the source file changed replaces the source's entries
    # (a copy of the model: the installed file is shared with tests running beside this one).
    other = load_model(None, "float16", prepared_dir=tmp_path)
    assert len(list(tmp_path.glob("*.safetensors"))) == 1  # one entry per source file, the newest
    source = tmp_path / "copy" / other.path.name
    source.parent.mkdir()
    shutil.copyfile(other.path, source)
    load_model(source, "float16", prepared_dir=tmp_path / "copies")
    (before,) = (tmp_path / "copies").glob("*.safetensors")
    stat = os.stat(source)
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    load_model(source, "float16", prepared_dir=tmp_path / "copies")
    (after,) = (tmp_path / "copies").glob("*.safetensors")
    assert after != before


def test_entries_name_their_own_key(tmp_path, monkeypatch, caplog):
    """A file renamed into another load's place is refused by its key, not read."""
    load_model(None, "bfloat16", prepared_dir=tmp_path)
    (entry,) = tmp_path.glob("*.safetensors")
    moved = tmp_path / "moved"
    entry.rename(moved)
    load_model(None, "float16", prepared_dir=tmp_path)
    (f16,) = tmp_path.glob("*.safetensors")
    moved.replace(f16)
    with caplog.at_level(logging.WARNING, logger="jaxinfer.prepared_weights"):
        loaded = load_model(None, "float16", prepared_dir=tmp_path)
    assert "made for another source file, code version or setting" in caplog.text
    assert jax.tree.leaves(loaded.params)[0].dtype == np.float16


def test_kept_only_for_a_single_device_load_with_a_directory(tmp_path):
    load_model(None, "bfloat16", place_for=lambda config, family: DevicePlacer(), prepared_dir=tmp_path)
    assert not list(tmp_path.iterdir())
    engine = EngineConfig(executable_cache_dir=str(tmp_path), dtype="bfloat16")
    assert weights_path(engine) == tmp_path / "weights"
    assert weights_path(EngineConfig(executable_cache_dir="none")) is None
    # `jaxinfer info` says whether a load with these settings would read its prepared weights.
    model = load_model(None, "bfloat16", prepared_dir=weights_path(engine))
    startup = info._startup(engine, model)
    assert startup["prepared_weights"] == str(tmp_path / "weights") and startup["prepared_weights_kept"]
    float16 = EngineConfig(executable_cache_dir=str(tmp_path), dtype="float16")
    assert not info._startup(float16, model)["prepared_weights_kept"]
