"""The orbax checkpoint format: round trips (any dtype, sharded reads, casts) and damaged checkpoints."""

import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from checkpoints import CheckpointError, OrbaxCheckpoint, is_orbax_checkpoint, save_arrays, save_params
from checkpoints.orbax_io import FORMAT_VERSION, METADATA_FILE, PARAMS_DIR


def _arrays():
    rng = np.random.default_rng(0)
    return {
        "embed": rng.normal(size=(16, 8)).astype(ml_dtypes.bfloat16),
        "layers.0.wq": rng.normal(size=(8, 4, 2)).astype(np.float32),
        "layers.0.wq_int8": rng.integers(-128, 127, size=(8, 4, 2), dtype=np.int8),
        "layers.0.wq_scale": rng.random(size=(4, 2)).astype(np.float32),
    }


def _target(name, shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(jax.devices()[0]))


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "ckpt"
    save_params(path, {k: jnp.asarray(v) for k, v in _arrays().items()}, {"family": "llama"})
    return path


def test_roundtrip_keeps_every_dtype(saved):
    ckpt = OrbaxCheckpoint(saved)
    assert ckpt.metadata == {"family": "llama", "format_version": FORMAT_VERSION}
    assert sorted(ckpt.keys()) == sorted(_arrays())
    for name, want in _arrays().items():
        assert ckpt.shape(name) == want.shape and ckpt.dtype(name) == want.dtype
        got = ckpt.get(name)
        assert got.dtype == want.dtype  # int8 (quantized values) and bfloat16 stay as saved
        np.testing.assert_array_equal(got, want)
    assert is_orbax_checkpoint(saved)


def test_restore_casts_and_reads_a_subset(saved):
    ckpt = OrbaxCheckpoint(saved)
    out = ckpt.restore({"embed": _target("embed", (16, 8), jnp.float32)})
    assert list(out) == ["embed"] and out["embed"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out["embed"]), _arrays()["embed"].astype(np.float32))


def test_restore_names_wrong_shapes_and_unknown_arrays(saved):
    ckpt = OrbaxCheckpoint(saved)
    with pytest.raises(CheckpointError, match=r"embed: saved \(16, 8\), asked \(8, 16\)"):
        ckpt.restore({"embed": _target("embed", (8, 16), jnp.float32)})
    with pytest.raises(CheckpointError, match="no arrays named lm_head"):
        ckpt.restore({"lm_head": _target("lm_head", (8, 16), jnp.float32)})


def test_half_written_checkpoint_is_named(saved):
    (saved / METADATA_FILE).unlink()  # the conversion died before its last write
    with pytest.raises(CheckpointError, match="half-written checkpoint.*did not finish"):
        OrbaxCheckpoint(saved)


def test_damaged_params_are_named(saved):
    (saved / PARAMS_DIR / "commit_success.txt").unlink()
    with pytest.raises(CheckpointError, match="incomplete orbax parameters"):
        OrbaxCheckpoint(saved)
    shutil.rmtree(saved / PARAMS_DIR)
    with pytest.raises(CheckpointError, match="missing or incomplete"):
        OrbaxCheckpoint(saved)


@pytest.mark.parametrize(
    "text,match",
    [
        (json.dumps({"format_version": FORMAT_VERSION + 1}), f"format_version {FORMAT_VERSION + 1} is newer"),
        ("{not json", "not valid JSON"),
        (json.dumps({"family": "llama"}), "no integer format_version"),
    ],
)
def test_bad_metadata_is_named(saved, text, match):
    (saved / METADATA_FILE).write_text(text)
    with pytest.raises(CheckpointError, match=match):
        OrbaxCheckpoint(saved)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        OrbaxCheckpoint(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="not a jaxinfer orbax checkpoint"):
        OrbaxCheckpoint(tmp_path)
    assert not is_orbax_checkpoint(tmp_path)


def test_save_refuses_to_overwrite(saved):
    with pytest.raises(CheckpointError, match="already exists"):
        save_arrays(saved, {"x": jnp.zeros(3)})
