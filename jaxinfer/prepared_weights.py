"""Prepared weights: a model's parameters as a load leaves them (GGUF blocks dequantized or
repacked, dtypes converted, q|k|v and gate|up fused, linear layers quantized, then in the
family's compute layout for one device), kept beside the executable store so that a warm start
reads them back instead of doing that work again.

On the 2-core CPU the embedded SmolLM2's load takes ~1.2-1.7 s (dequantizing its Q4_1 / Q8_0
blocks to float32, then fusing); reading its 538 MB of prepared weights back takes ~0.25-0.45 s.

An entry is one safetensors file `<source>-<key>.safetensors` in `<executable store>/weights`,
one per source file (a newer entry for the same file replaces the older ones):

    key = sha256(FORMAT, the code version of every package a load runs, jax and jaxlib, the
          device's platform and kind, the source file's resolved path, size and mtime, the
          dtype and the quantization asked for)

Each leaf is stored as its raw bytes (uint8), its dtype and shape in the file's metadata with
the key and the parameter tree's structure (pickled: like the executable store, the directory
must be as trusted as the Python environment). An entry whose key, structure or sizes do not
match is refused with a warning, removed, and the model loaded from its source again. Entries
are written to a temporary name and renamed. Only single-device loads are kept, and only those
whose parameters fit MAX_BYTES with twice their size free on the disk.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import pickle
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from checkpoints.atomic import atomic_target
from jaxinfer.config.caches import code_version

logger = logging.getLogger(__name__)

FORMAT = "jaxinfer-prepared-weights-1"
SUFFIX = ".safetensors"
# Every package whose code decides the parameters a load produces.
PACKAGES = ("jaxinfer", "checkpoints", "sharding", "pallas_kernels")
MAX_BYTES = 8 << 30


class PreparedWeights:
    """The prepared-weights entry of one load: `load` reads it back (None when there is none, or
    it cannot be used), `save` writes it."""

    def __init__(self, directory: Path, source: Path, dtype: Any, quantization: Any, device: jax.Device) -> None:
        source = source.expanduser().resolve()
        stat = source.stat()
        identity = [
            FORMAT,
            code_version(PACKAGES),
            jax.__version__,
            jaxlib.__version__,
            device.platform,
            device.device_kind,
            str(source),
            stat.st_size,
            stat.st_mtime_ns,
            repr(dtype),
            repr(quantization),
        ]
        self.key = hashlib.sha256(json.dumps(identity).encode()).hexdigest()
        self.prefix = hashlib.sha256(str(source).encode()).hexdigest()[:16]
        self.path = directory / f"{self.prefix}-{self.key[:32]}{SUFFIX}"
        self.source = source
        self.device = device

    def load(self) -> Any | None:
        """The stored parameters on the device, or None (no entry; an unusable one is removed)."""
        if not self.path.exists():
            return None
        try:
            with safe_open(self.path, framework="numpy") as f:
                meta = f.metadata() or {}
                if meta.get("key") != self.key:
                    raise ValueError("made for another source file, code version or setting")
                treedef = pickle.loads(base64.b64decode(meta["treedef"]))
                leaves = []
                for i, (dtype, shape) in enumerate(json.loads(meta["leaves"])):
                    raw = f.get_tensor(str(i))
                    leaves.append(jax.device_put(raw.view(jnp.dtype(dtype)).reshape(shape), self.device))
            if treedef.num_leaves != len(leaves):
                raise ValueError(f"{len(leaves)} arrays for a tree of {treedef.num_leaves}")
            params = jax.tree.unflatten(treedef, leaves)
        except Exception as e:  # a truncated, corrupt or foreign file: never used
            logger.warning("prepared weights %s not used (%s); loading %s again", self.path, e, self.source)
            with contextlib.suppress(OSError):
                self.path.unlink()
            return None
        logger.info("read the prepared weights of %s from %s", self.source, self.path)
        return params

    def save(self, params: Any) -> bool:
        """Writes `params` as this load's entry (removing the source's older ones); False where
        they are not kept (not all device arrays, over MAX_BYTES, or too little disk)."""
        leaves, treedef = jax.tree.flatten(params)
        if not all(isinstance(leaf, jax.Array) for leaf in leaves):
            return False
        size = sum(leaf.nbytes for leaf in leaves)
        directory = self.path.parent
        directory.mkdir(parents=True, exist_ok=True)
        if size > MAX_BYTES or shutil.disk_usage(directory).free < 2 * size:
            logger.info("prepared weights of %s not kept: %.1f GB", self.source, size / 1e9)
            return False
        arrays = [np.asarray(leaf) for leaf in leaves]
        meta = {
            "format": FORMAT,
            "key": self.key,
            "source": str(self.source),
            "treedef": base64.b64encode(pickle.dumps(treedef)).decode(),
            "leaves": json.dumps([[a.dtype.name, list(a.shape)] for a in arrays]),
        }
        tensors = {str(i): np.ascontiguousarray(a).reshape(-1).view(np.uint8) for i, a in enumerate(arrays)}
        with atomic_target(self.path) as tmp:
            save_file(tensors, tmp, metadata=meta)
        for old in directory.glob(f"{self.prefix}-*{SUFFIX}"):
            if old != self.path:
                with contextlib.suppress(OSError):
                    old.unlink()
        logger.info("kept the prepared weights of %s (%.0f MB) in %s", self.source, size / 1e6, self.path)
        return True
