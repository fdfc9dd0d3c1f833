"""ExecutableStore: compiled step programs kept on disk and loaded without tracing, lowering or compiling.

JAX's persistent compilation cache is keyed by a program's HLO, so a start-up that reads it still
traces and lowers every variant (on the 2-core CPU ~0.4 s each, tens of variants for a server).
This store is keyed by everything that shapes a program before it exists, so a warm start goes
straight from the key to the executable (jax.experimental.serialize_executable):

    key = sha256(FORMAT, the program's name, the environment (jax and jaxlib versions, backend
          and its version, device kinds and count, XLA_FLAGS / LIBTPU_INIT_ARGS), the code
          version (a hash of every source file of the packages that reach a jit), the context
          (model config, engine config), and the abstract signature of every argument: tree
          structure, shapes, dtypes, shardings and layouts)

An entry is one file `<key>.jxe`: MAGIC, a JSON header (the key, the fingerprint it was made
under, the payload's length and sha256), then the payload (the serialized executable and its
argument and result trees, pickled). An entry from another environment, code version or
config has another key and is never looked at; a file whose header or checksum does not match
(truncated, corrupt, renamed) is refused with a warning, removed, and the program compiled
again. Files are written to a temporary name and renamed, so concurrent engines never read a
half-written entry. Loading an entry runs the code it holds, as reading JAX's own cache does:
the directory must be as trusted as the Python environment.

Only a freshly compiled executable is stored: on the CPU an executable read from JAX's
persistent cache and serialized again loses its functions ("Function ... not found" when it
runs), so compiles meant for the store run with JAX's cache off (`fresh_compiles`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pickle
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jaxlib
import numpy as np
from jax.experimental import serialize_executable
from jax.experimental.compilation_cache import compilation_cache

from checkpoints.atomic import atomic_target
from jaxinfer.config import caches

logger = logging.getLogger(__name__)

FORMAT = 1
MAGIC = b"jaxinfer-executable\n"
SUFFIX = ".jxe"
# The packages whose code can reach a jitted program (serving and checkpoints only feed it).
CODE_PACKAGES = ("jaxinfer", "sharding", "pallas_kernels")
ENV_FLAGS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
MAX_INDEXED = 512
# Entry path -> the future of its (header, executable), started by `prefetch`.
_PREFETCHED: dict[Path, Future[tuple[dict[str, Any], jax.stages.Compiled] | None]] = {}


def code_version() -> str:
    """sha256 over every .py file of CODE_PACKAGES (once per process)."""
    return caches.code_version(CODE_PACKAGES)


def environment(devices: Sequence[jax.Device]) -> dict[str, Any]:
    """What, besides our code and config, decides the executable XLA builds for `devices`."""
    client = devices[0].client
    return {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "platform": client.platform,
        "platform_version": client.platform_version,
        "devices": [f"{d.platform}:{d.device_kind}:{d.id}" for d in devices],
        "processes": jax.process_count(),
        **{name: os.environ.get(name, "") for name in ENV_FLAGS},
    }


def signature(tree: Any) -> str:
    """The abstract signature of a call's arguments: structure, and each leaf's shape, dtype and
    (for device arrays) sharding and layout; host arrays are marked as such."""
    leaves, treedef = jax.tree.flatten(tree)
    parts = [str(treedef)]
    for x in leaves:
        if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):  # an abstract one signs as its array would
            parts.append(f"{x.shape}{x.dtype}{x.weak_type}|{x.sharding!r}|{getattr(x, 'format', None)!r}")
        else:
            x = np.asarray(x)
            parts.append(f"{x.shape}{x.dtype}|host")
    return "\n".join(parts)


class ExecutableStore:
    """Compiled programs under `directory`, for one engine (its devices and context)."""

    def __init__(self, directory: Path, devices: Sequence[jax.Device], context: dict[str, str], index: str) -> None:
        self.directory, self.index, self.devices = directory, index, list(devices)
        self.fingerprint = {
            "format": FORMAT,
            "code": code_version(),
            **environment(devices),
            **context,
        }
        self._prefix = json.dumps(self.fingerprint, sort_keys=True).encode()
        self.loaded = self.stored = self.refused = 0

    def key(self, name: str, args: Any) -> str:
        digest = hashlib.sha256(self._prefix)
        digest.update(b"\0" + name.encode() + b"\0" + signature(args).encode())
        return digest.hexdigest()

    def path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    def load(self, key: str) -> jax.stages.Compiled | None:
        """The executable stored under `key`, loaded onto this engine's devices (by a prefetch
        if one has it: `prefetch`); None when there is none, or (with a warning, the file
        removed) when it is not a sound entry for `key` made under this fingerprint."""
        path = self.path(key)
        future = _PREFETCHED.pop(path, None)
        if future is not None and future.cancel():  # still queued: read here, beside the prefetch's threads
            future = None
        try:
            entry = future.result() if future is not None else read_entry(path)
            if entry is None:
                return None
            header, compiled = entry
            if header.get("key") != key or header.get("fingerprint") != self.fingerprint:
                raise ValueError("made for another program, environment, code version or config")
        except OSError as e:
            logger.warning("executable %s unreadable (%s): compiling it", path, e.strerror or e)
            return None
        except Exception as e:  # a corrupt entry of any kind is recompiled, never run
            self.refused += 1
            logger.warning("executable %s refused (%s): compiling it again", path, e)
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        self.loaded += 1
        return compiled

    def remember(self, keys: Sequence[str]) -> None:
        """Records `keys` as programs an engine of this store's index (programs.index_key) uses,
        for the next start's `prefetch`; the index keeps the newest MAX_INDEXED."""
        path = self.directory / "index" / f"{self.index}.json"
        try:
            known = [k for k in read_index(path) if k not in keys]
            write_atomically(path, json.dumps([*keys, *known][:MAX_INDEXED]).encode())
        except OSError as e:
            logger.debug("executable index %s not written: %s", path, e)

    def save(self, key: str, compiled: jax.stages.Compiled) -> None:
        """Keeps `compiled` (freshly compiled: see the module's note) under `key`; a failure to
        write costs only the entry (logged)."""
        try:
            payload = pickle.dumps(serialize_executable.serialize(compiled))
            header = {
                "key": key,
                "fingerprint": self.fingerprint,
                "device_ids": [d.id for d in self.devices],  # in the order the program runs on them
                "length": len(payload),
                "sha256": hashlib.sha256(payload).hexdigest(),
            }
            write_atomically(self.path(key), MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + payload)
        except Exception as e:  # noqa: BLE001  # the program runs either way
            logger.warning("executable %s not stored: %s", self.path(key), e)
            return
        self.stored += 1


def write_atomically(path: Path, data: bytes) -> None:
    """`data` as `path`, written to a temporary name beside it and renamed (readers never see half
    a file; the temporary is removed if the write fails)."""
    with atomic_target(path) as tmp:
        tmp.write_bytes(data)


def read_entry(path: Path) -> tuple[dict[str, Any], jax.stages.Compiled] | None:
    """(header, executable) of an entry file, its checksum checked; None if there is no file.
    Thread-safe: the deserialization, most of the time, runs without the GIL."""
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        return None
    if not blob.startswith(MAGIC):
        raise ValueError("not an executable entry")
    header_end = blob.find(b"\n", len(MAGIC))
    if header_end < 0:
        raise ValueError("truncated header")
    header = json.loads(blob[len(MAGIC) : header_end])
    payload = blob[header_end + 1 :]
    if len(payload) != header.get("length"):
        raise ValueError(f"truncated: {len(payload)} of {header.get('length')} bytes")
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise ValueError("checksum mismatch")
    # Loaded onto the devices it was compiled for, by id (without them JAX assumes every device of
    # the process, and an executable for fewer fails a check that ends the process).
    local = {d.id: d for d in jax.devices()}
    ids = header.get("device_ids")
    if not isinstance(ids, list) or not ids or any(i not in local for i in ids):
        raise ValueError(f"made for devices {ids!r}, not among this process's")
    serialized, in_tree, out_tree = pickle.loads(payload)
    devices = [local[i] for i in ids]
    return header, serialize_executable.deserialize_and_load(serialized, in_tree, out_tree, execution_devices=devices)


def read_index(path: Path) -> list[str]:
    try:
        keys = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [k for k in keys if isinstance(k, str)] if isinstance(keys, list) else []


def prefetch(directory: Path, index: str) -> int:
    """Starts loading, on background threads, the executables the index `index` lists (what
    an engine of this config used last time), while the caller reads the weights; the
    engine's store takes each from here (`ExecutableStore.load`), checked against its key and
    fingerprint like any entry. Returns how many it started."""
    paths = [directory / f"{key}{SUFFIX}" for key in read_index(directory / "index" / f"{index}.json")]
    paths = [p for p in paths if p not in _PREFETCHED and p.is_file()]
    if not paths:
        return 0
    # A core left to the caller, which reads the weights meanwhile.
    pool = ThreadPoolExecutor(min(len(paths), max(1, (os.cpu_count() or 1) - 1)), thread_name_prefix="prefetch")
    for path in paths:
        _PREFETCHED[path] = pool.submit(read_entry, path)
    pool.shutdown(wait=False)
    return len(paths)


@contextlib.contextmanager
def fresh_compiles() -> Iterator[None]:
    """JAX's persistent compilation cache off for the compiles inside (process-wide), so that
    what they build can be stored (see the module's note). JAX decides whether its cache is in
    use once, and again only after `reset_cache`."""
    previous = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", previous)
        compilation_cache.reset_cache()
