"""Orbax checkpoints: a flat {name: array} tree saved with orbax-checkpoint, and a metadata file.

    DIR/params/                  the arrays (orbax's OCDBT + zarr layout, via tensorstore)
    DIR/jaxinfer_checkpoint.json {"format_version", "family", "dtype", "quantization", ...}
    DIR/...                      whatever files the writer puts beside them (config, tokenizer)

The metadata file is written last and marks the checkpoint complete: a directory with params but
no metadata is a conversion that did not finish. Restoring takes a target per array (shape,
dtype, sharding): orbax casts to the target dtype and each process reads only the shards its own
devices hold, straight from the files, so no host ever assembles a whole array it does not keep.
Paths may be local directories or `gs://bucket/...` URIs (tensorstore reads GCS itself).
Any dtype round-trips, integer (quantized) arrays and their scales included.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from checkpoints.errors import CheckpointError

if TYPE_CHECKING:
    from etils.epath import Path as EPath

FORMAT_VERSION = 1
METADATA_FILE = "jaxinfer_checkpoint.json"
PARAMS_DIR = "params"
# Bytes of arrays a restore holds on the host at once, in GiB (orbax's own throttle): the host
# never stages the whole model on its way to the devices.
RESTORE_CONCURRENT_GB = 1


def _checkpointer(**options):
    import orbax.checkpoint as ocp

    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**options))


def epath(path: str | os.PathLike[str]) -> EPath:
    """A path object for local paths and gs:// URIs alike (etils.epath, which orbax uses)."""
    from etils import epath as _epath

    return _epath.Path(str(path))


def is_orbax_checkpoint(path: Any) -> bool:
    """Whether `path` is a directory laid out as above (complete or not)."""
    path = epath(path)
    return path.is_dir() and ((path / METADATA_FILE).exists() or (path / PARAMS_DIR).exists())


def save_arrays(directory: Any, arrays: Mapping[str, Any]) -> None:
    """Saves the arrays (jax.Arrays, sharded or not; every process of a multi-host run calls this
    and writes its own shards) under DIR/params, which must not exist yet."""
    import orbax.checkpoint as ocp

    directory = epath(directory)
    if (directory / PARAMS_DIR).exists():
        raise CheckpointError(f"{directory / PARAMS_DIR} already exists; choose a new destination")
    directory.mkdir(parents=True, exist_ok=True)
    # Uncompressed: with orbax's default zstd chunks a restore peaked at 2.8x the parameter bytes
    # instead of 1.2x, and at 1.7x the time on 8 devices (benchmarks/RESULTS.md).
    with _checkpointer(use_compression=False) as checkpointer:
        checkpointer.save(directory / PARAMS_DIR, args=ocp.args.PyTreeSave(dict(arrays)))


def write_metadata(directory: Any, metadata: Mapping[str, Any]) -> None:
    """The metadata file, last: it marks the checkpoint complete (process 0 writes it)."""
    import jax

    if jax.process_index() == 0:
        record = {"format_version": FORMAT_VERSION, **metadata}
        (epath(directory) / METADATA_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def save_params(directory: Any, arrays: Mapping[str, Any], metadata: Mapping[str, Any]) -> None:
    """`save_arrays`, then `write_metadata`."""
    save_arrays(directory, arrays)
    write_metadata(directory, metadata)


class OrbaxCheckpoint:
    """A saved checkpoint: `metadata`, `keys()`, `shape(name)`, `dtype(name)`, `restore(targets)`,
    and `get(name)` (one whole array on the host, for inspection)."""

    def __init__(self, directory: Any) -> None:
        self.path = epath(directory)
        meta_file, params = self.path / METADATA_FILE, self.path / PARAMS_DIR
        if not self.path.is_dir():
            raise FileNotFoundError(f"orbax checkpoint directory not found: {self.path}")
        if not meta_file.exists():
            raise CheckpointError(
                f"{self.path}: half-written checkpoint: {PARAMS_DIR}/ is there but {METADATA_FILE} "
                "is not (the conversion did not finish); convert again into a new directory"
                if params.exists()
                else f"{self.path}: not a jaxinfer orbax checkpoint (no {METADATA_FILE})"
            )
        self.metadata = _read_metadata(meta_file)
        if not params.is_dir() or not (params / "commit_success.txt").exists():
            raise CheckpointError(
                f"{params}: missing or incomplete orbax parameters (no commit_success.txt); the checkpoint is damaged"
            )
        self._params = params
        self._arrays = self._array_metadata()

    def _array_metadata(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        try:
            with _checkpointer() as checkpointer:
                tree = checkpointer.metadata(self._params).item_metadata.tree
        except Exception as e:  # orbax raises assorted errors on damaged metadata
            raise CheckpointError(f"{self._params}: unreadable orbax metadata ({type(e).__name__}: {e})") from e
        if not isinstance(tree, Mapping):
            raise CheckpointError(f"{self._params}: expected a flat tree of named arrays")
        return {name: (tuple(m.shape), np.dtype(m.dtype)) for name, m in tree.items()}

    def keys(self) -> list[str]:
        return list(self._arrays)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._arrays[name][0]

    def dtype(self, name: str) -> np.dtype:
        return self._arrays[name][1]

    def restore(self, targets: Mapping[str, Any]) -> dict[str, Any]:
        """{name: jax.ShapeDtypeStruct with a sharding} -> {name: jax.Array} for those names."""
        import orbax.checkpoint as ocp

        unknown = sorted(set(targets) - set(self._arrays))
        if unknown:
            raise CheckpointError(f"{self.path}: no arrays named {', '.join(unknown[:8])}")
        bad = [
            f"{n}: saved {self.shape(n)}, asked {tuple(t.shape)}"
            for n, t in targets.items()
            if tuple(t.shape) != self.shape(n)
        ]
        if bad:
            raise CheckpointError(f"{self.path}: shapes differ from the saved ones: " + "; ".join(bad[:8]))
        args = {
            n: ocp.ArrayRestoreArgs(sharding=t.sharding, global_shape=tuple(t.shape), dtype=t.dtype)
            for n, t in targets.items()
        }
        with _checkpointer(restore_concurrent_gb=RESTORE_CONCURRENT_GB) as checkpointer:
            return checkpointer.restore(
                self._params, args=ocp.args.PyTreeRestore(item=dict(targets), restore_args=args, partial_restore=True)
            )

    def get(self, name: str) -> np.ndarray:
        import jax

        target = jax.ShapeDtypeStruct(
            self.shape(name), self.dtype(name), sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])
        )
        return np.asarray(self.restore({name: target})[name])


def _read_metadata(meta_file: EPath) -> dict[str, Any]:
    try:
        record = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{meta_file}: not valid JSON ({e})") from e
    if not isinstance(record, dict) or not isinstance(record.get("format_version"), int):
        raise CheckpointError(f"{meta_file}: no integer format_version")
    if record["format_version"] > FORMAT_VERSION:
        raise CheckpointError(
            f"{meta_file}: format_version {record['format_version']} is newer than this jaxinfer "
            f"reads ({FORMAT_VERSION}); upgrade jaxinfer"
        )
    return record
