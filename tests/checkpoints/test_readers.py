"""Checkpoint readers: safetensors (single, sharded, corrupt) and GGUF dequantization."""

import json
import os
import shutil
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf_builder import write_gguf
from safetensors.numpy import save_file
from testpaths import FIXTURES, smollm2_gguf_path

from checkpoints import CheckpointError, GGUFCheckpoint, SafetensorsCheckpoint, SafetensorsFile, gguf_io


def _tensors():
    rng = np.random.default_rng(0)
    return {
        "a": rng.normal(size=(3, 5)).astype(np.float32),
        "b": rng.normal(size=(7,)).astype(np.float16),
        "c": np.arange(6, dtype=np.int32).reshape(2, 3),
    }


def test_single_file_roundtrip(tmp_path):
    save_file(_tensors(), str(tmp_path / "model.safetensors"))
    ckpt = SafetensorsCheckpoint(tmp_path)
    assert sorted(ckpt.keys()) == ["a", "b", "c"]
    for name, ref in _tensors().items():
        np.testing.assert_array_equal(ckpt.get(name), ref)
        assert ckpt.get(name).dtype == ref.dtype and ckpt.shape(name) == ref.shape


def test_bfloat16_without_torch(tmp_path):
    x = np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4)
    raw = x.astype(ml_dtypes.bfloat16)
    header = json.dumps({"w": {"dtype": "BF16", "shape": [3, 4], "data_offsets": [0, raw.nbytes]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + raw.tobytes())
    got = SafetensorsFile(tmp_path / "model.safetensors").get("w")
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got.astype(np.float32), raw.astype(np.float32))


def test_sharded_with_index(tmp_path):
    t = _tensors()
    save_file({"a": t["a"]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": t["b"], "c": t["c"]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {
        "metadata": {},
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
            "c": "model-00002-of-00002.safetensors",
        },
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    ckpt = SafetensorsCheckpoint(tmp_path)
    for name, ref in t.items():
        np.testing.assert_array_equal(ckpt.get(name), ref)


def test_index_naming_a_tensor_its_shard_lacks(tmp_path):
    save_file({"a": _tensors()["a"]}, str(tmp_path / "s1.safetensors"))
    index = {"weight_map": {"a": "s1.safetensors", "zz": "s1.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="'zz'"):
        SafetensorsCheckpoint(tmp_path)


def test_index_naming_a_missing_shard(tmp_path):
    index = {"weight_map": {"a": "gone.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="gone.safetensors"):
        SafetensorsCheckpoint(tmp_path)


def test_truncated_file_names_tensor_and_sizes(tmp_path):
    src = FIXTURES / "hf" / "llama3" / "model.safetensors"
    data = src.read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"truncated: tensor '.+' needs bytes up to \d+ but the file has \d+"):
        SafetensorsFile(tmp_path / "model.safetensors")


def test_garbage_and_empty_files(tmp_path):
    (tmp_path / "x.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="too short"):
        SafetensorsFile(tmp_path / "x.safetensors")
    (tmp_path / "x.safetensors").write_bytes((20).to_bytes(8, "little") + b"{this is not json!!!")
    with pytest.raises(CheckpointError, match="unreadable safetensors header"):
        SafetensorsFile(tmp_path / "x.safetensors")
    (tmp_path / "x.safetensors").write_bytes((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match="header length"):
        SafetensorsFile(tmp_path / "x.safetensors")


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no .safetensors files"):
        SafetensorsCheckpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="nothing.gguf"):
        GGUFCheckpoint(tmp_path / "nothing.gguf")


def test_not_a_gguf(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(CheckpointError, match="bad.gguf"):
        GGUFCheckpoint(tmp_path / "bad.gguf")


@pytest.mark.parametrize(
    "qtype,tol",
    [
        (Q.F32, 0),
        (Q.F16, 2e-3),
        (Q.BF16, 2e-2),
        (Q.Q8_0, 0.03),
        (Q.Q4_0, 0.3),
        (Q.Q4_1, 0.3),
        (Q.Q5_0, 0.2),
        (Q.Q5_1, 0.2),
    ],
)
def test_gguf_dequantizes_each_type(tmp_path, qtype, tol):
    w = np.random.default_rng(1).normal(size=(8, 64)).astype(np.float32)
    path = write_gguf(tmp_path / "t.gguf", "llama", {}, {"w": w}, {"w": qtype})
    ckpt = GGUFCheckpoint(path)
    got = ckpt.get("w")
    assert got.shape == (8, 64) and ckpt.shape("w") == (8, 64)
    assert np.abs(got.astype(np.float32) - w).max() <= tol
    assert ckpt.quant_type("w") == qtype.name


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_gguf_k_quants(tmp_path, qtype):
    # gguf cannot quantize K-quants, so write raw blocks: random bytes with sane f16 scales.
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 3, 2 * block
    raw = np.random.default_rng(2).integers(0, 256, size=(rows, cols // block * type_size), dtype=np.uint8)
    raw = raw.view(np.uint8)
    scales = np.full(raw.size // 2, 0.01, np.float16).view(np.uint8)
    raw = np.where(raw > 250, scales[: raw.size].reshape(raw.shape), raw).astype(np.uint8)
    writer = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    writer.add_tensor("w", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ckpt = GGUFCheckpoint(tmp_path / "k.gguf")
    got = ckpt.get("w")
    assert got.shape == (rows, cols) and got.dtype == np.float32
    np.testing.assert_array_equal(got, gguf.quants.dequantize(raw, qtype).reshape(rows, cols))


def test_gguf_metadata_values(tmp_path):
    path = write_gguf(
        tmp_path / "m.gguf",
        "llama",
        {"llama.block_count": 3, "general.name": "x"},
        {"w": np.zeros((2, 32), np.float32)},
    )
    meta = GGUFCheckpoint(path).metadata
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == 3
    assert meta["general.name"] == "x"


def test_a_gguf_file_is_parsed_once_per_version(tmp_path, monkeypatch):
    """gguf's reader walks every vocabulary string (seconds for a real model): a process that
    opens one file again reuses the parse, and a file rewritten in place is read afresh."""
    parses = []
    real_reader = gguf_io._reader_class()
    monkeypatch.setattr(gguf_io, "_reader_class", lambda: lambda *a: parses.append(a) or real_reader(*a))
    path = write_gguf(tmp_path / "once.gguf", "llama", {"general.name": "first"}, {"w": np.ones((2, 32), np.float32)})
    first, again = GGUFCheckpoint(path), GGUFCheckpoint(tmp_path / "." / "once.gguf")
    assert len(parses) == 1 and again.metadata["general.name"] == "first"
    np.testing.assert_array_equal(again.get("w"), np.ones((2, 32), np.float32))
    first.metadata["general.name"] = "changed by a caller"  # each checkpoint owns its dict
    assert GGUFCheckpoint(path).metadata["general.name"] == "first"
    write_gguf(path, "llama", {"general.name": "second, longer"}, {"w": np.zeros((4, 32), np.float32)})
    rewritten = GGUFCheckpoint(path)
    assert len(parses) == 2 and rewritten.metadata["general.name"] == "second, longer"
    assert rewritten.shape("w") == (4, 32)


def test_copy_of_fixture_loads(tmp_path):
    shutil.copytree(FIXTURES / "hf" / "qwen2", tmp_path / "m")
    assert "model.embed_tokens.weight" in SafetensorsCheckpoint(tmp_path / "m").keys()


def test_the_plain_view_reader_parses_what_ggufs_own_reader_does():
    """The default model's GGUF (a 49k-token vocabulary and merges, Q8_0 and F32 tensors) through
    the reader GGUFCheckpoint uses and through gguf.GGUFReader itself: the same fields with the
    same contents, the same tensors at the same offsets with equal data; and the fast one's
    tensors are views of the file, not copies."""
    path = str(smollm2_gguf_path())
    fast, stock = gguf_io._reader_class()(path), gguf.GGUFReader(path)
    assert type(fast) is not gguf.GGUFReader and isinstance(fast, gguf.GGUFReader)
    assert list(fast.fields) == list(stock.fields)
    for key, field in stock.fields.items():
        assert fast.fields[key].types == field.types, key
        assert fast.fields[key].contents() == field.contents(), key
    assert [t.name for t in fast.tensors] == [t.name for t in stock.tensors]
    for a, b in zip(fast.tensors, stock.tensors):
        assert (a.tensor_type, a.data_offset, a.n_bytes) == (b.tensor_type, b.data_offset, b.n_bytes), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert type(a.data) is np.ndarray and np.shares_memory(a.data, fast.data), a.name
        np.testing.assert_array_equal(a.data, b.data)


def parsed_and_indexed(path, index_dir, monkeypatch):
    """The file opened with no index (gguf parses it and the index is written), then again from
    the index alone (gguf's reader made unusable)."""
    monkeypatch.setenv(gguf_io.INDEX_DIR_VAR, str(index_dir))
    gguf_io._parse.cache_clear()
    parsed = GGUFCheckpoint(path)
    assert len(list(index_dir.glob("*.json"))) == 1
    gguf_io._parse.cache_clear()
    with monkeypatch.context() as m:
        m.setattr(gguf_io, "_reader_class", lambda: pytest.fail("parsed again instead of read from the index"))
        indexed = GGUFCheckpoint(path)
    gguf_io._parse.cache_clear()
    return parsed, indexed


def test_the_index_gives_what_the_parse_gave(tmp_path, monkeypatch):
    """SmolLM2 (Q8_0, F32; a 49k vocabulary) and a file with every plain and block type."""
    rng = np.random.default_rng(0)
    tensors = {f"t{i}": rng.standard_normal((4, 64)).astype(np.float32) for i in range(4)}
    qtypes = {"t0": Q.F32, "t1": Q.F16, "t2": Q.Q8_0, "t3": Q.Q4_1}
    small = write_gguf(tmp_path / "small.gguf", "llama", {"general.name": "x"}, tensors, qtypes)
    for path in (smollm2_gguf_path(), small):
        parsed, indexed = parsed_and_indexed(path, tmp_path / f"index-{Path(path).stem}", monkeypatch)
        assert indexed.metadata == parsed.metadata and indexed.keys() == parsed.keys()
        for name in parsed.keys():
            a, b = parsed._tensors[name].data, indexed._tensors[name].data
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert parsed.shape(name) == indexed.shape(name) and parsed.quant_type(name) == indexed.quant_type(name)
            np.testing.assert_array_equal(parsed.get(name), indexed.get(name))
            np.testing.assert_array_equal(parsed.raw(name), indexed.raw(name))


def test_a_changed_or_broken_index_is_never_used(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    path = write_gguf(tmp_path / "m.gguf", "llama", {"general.name": "one"}, {"w": rng.standard_normal((2, 32))})
    index_dir = tmp_path / "index"
    parsed_and_indexed(path, index_dir, monkeypatch)
    # The file rewritten (new size and time): a new index, the new contents.
    write_gguf(path, "llama", {"general.name": "two", "x.extra": 3}, {"w": rng.standard_normal((2, 32))})
    os.utime(path, ns=(1, 1))
    gguf_io._parse.cache_clear()
    assert GGUFCheckpoint(path).metadata["general.name"] == "two"
    assert len(list(index_dir.glob("*.json"))) == 2
    # A corrupt index is parsed past (and rewritten).
    for index in index_dir.glob("*.json"):
        index.write_text("{not json")
    gguf_io._parse.cache_clear()
    assert GGUFCheckpoint(path).metadata["general.name"] == "two"
    gguf_io._parse.cache_clear()
    monkeypatch.setenv(gguf_io.INDEX_DIR_VAR, "none")
    assert GGUFCheckpoint(path).metadata["general.name"] == "two"
