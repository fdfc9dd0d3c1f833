"""Programs: the compiled variants of the step and the decode window, by name and input signature.

With an ExecutableStore (executables.py) the compiled step launches each variant from this table
of executables instead of through the jit: a variant missing from the table is read from the
store (no trace, lower or compile), else traced, lowered, compiled with JAX's persistent cache
off and stored. Looking a variant up costs one flatten of the step's inputs: the table's key is
their tree structure and each leaf's shape, dtype and whether it is still on the host, which
is as much as the jit's own signature varies between a step's calls (the params, caches,
sampled tokens and page table keep theirs; tests/jaxinfer/test_warm_up.py counts that nothing
compiles after warm-up through the jit, so its signatures stay put). Without a store
(executable_cache_dir none, several processes) the jit is called as before and JAX's
persistent cache is all there is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.config.caches import cache_path
from jaxinfer.config.compile import DEFAULT_EXECUTABLES_DIR, EXECUTABLES_DIR_VAR
from jaxinfer.worker.executables import ExecutableStore, code_version, fresh_compiles, prefetch
from jaxinfer.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)

Compile = Callable[[list[jax.stages.Lowered]], list[jax.stages.Compiled]]


def store_path(engine: EngineConfig) -> Path | None:
    """EngineConfig.executable_cache_dir as a directory; None when it is off."""
    return cache_path(engine.compile.executable_cache_dir, EXECUTABLES_DIR_VAR, DEFAULT_EXECUTABLES_DIR)


def weights_path(engine: EngineConfig) -> Path | None:
    """Where prepared weights are kept (jaxinfer.prepared_weights): the store's `weights`
    folder; None when the store is off or several processes share the load."""
    path = store_path(engine)
    return None if path is None or jax.process_count() > 1 else path / "weights"


def shaping_context(engine: EngineConfig) -> dict[str, str]:
    """The engine config as the store keys it: every group, less where the caches live and
    when the variants compile."""
    context = {f.name: repr(getattr(engine, f.name)) for f in dataclasses.fields(engine)}
    compile_ = dataclasses.replace(engine.compile, compilation_cache_dir=None, executable_cache_dir=None)
    context["compile"] = repr(dataclasses.replace(compile_, compile_in_background=False))
    return context


def index_key(engine: EngineConfig) -> str:
    """What a start knows before it reads its weights: our code, jax, the config and the model
    file (path, size, time); the store's index of this key lists the programs such an engine
    used last time (a hint for `prefetch`: each is still checked against its own key)."""
    identity: list[Any] = [repr(engine.load.model)]
    if engine.load.model is not None:
        path = Path(engine.load.model).expanduser()
        with contextlib.suppress(OSError):
            stat = path.stat()
            identity += [str(path.resolve()), stat.st_size, stat.st_mtime_ns]
    context = shaping_context(engine)  # as the user gave it: the engine chooses the page size later
    context["cache"] = repr(dataclasses.replace(engine.cache, page_size=None))
    text = json.dumps([code_version(), jax.__version__, context, identity], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def prefetch_programs(engine: EngineConfig) -> int:
    """Starts reading the executables an engine of this config used last time, in the
    background (executables.prefetch); called before the weights load. Returns how many."""
    path = store_path(engine)
    if path is None or jax.process_count() > 1:
        return 0
    return prefetch(path, index_key(engine))


def executable_store(
    engine: EngineConfig, config: ModelConfig, mesh: jax.sharding.Mesh | None, device: jax.Device
) -> ExecutableStore | None:
    """The store EngineConfig.executable_cache_dir names for an engine on `mesh` (or one
    `device`); None when it is off or several processes run the engine (each would need the
    others' executables)."""
    path = store_path(engine)
    if path is None or jax.process_count() > 1:
        return None
    devices = [device] if mesh is None else list(mesh.devices.flat)
    return ExecutableStore(path, devices, {"model": repr(config), **shaping_context(engine)}, index_key(engine))


def table_key(name: str, inputs: Any) -> tuple[Any, ...]:
    leaves, treedef = jax.tree.flatten(inputs)
    return name, treedef, tuple((x.shape, x.dtype, isinstance(x, jax.Array)) for x in leaves)


@dataclasses.dataclass
class Record:
    """One variant's warm-up: what it is, where it came from ("store": read from the executable
    store; "compiled": compiled, or read from JAX's persistent cache), and its seconds."""

    variant: str
    source: str
    seconds: float


def describe(name: str, inputs: StepInputs[Any]) -> str:
    """A variant in words: its program, token bucket and what its inputs carry."""
    sampling = inputs.sampling
    parts = [name, f"tokens={inputs.token_ids.shape[-1]}"]
    parts += ["penalties"] if sampling is not None and sampling.history is not None else []
    parts += ["prompt-logprobs"] if inputs.prompt is not None else []
    parts += ["verify"] if inputs.spec is not None else []
    parts += ["greedy"] if sampling is not None and sampling.plain else []
    return " ".join(parts)


class _Timed:
    """A lowered program whose compile records its seconds (compile_all calls `compile`)."""

    def __init__(self, lowered: jax.stages.Lowered) -> None:
        self.lowered, self.seconds = lowered, 0.0

    def compile(self) -> jax.stages.Compiled:
        start = time.perf_counter()
        try:
            return self.lowered.compile()
        finally:
            self.seconds = time.perf_counter() - start


class Programs:
    """`args` of a program: (params, kv_caches, inputs, prev_tokens, page_table); only the
    inputs (index 2) vary between calls of one CompiledStep."""

    def __init__(
        self, store: ExecutableStore | None, mesh_context: Callable[[], contextlib.AbstractContextManager[Any]]
    ) -> None:
        self.store, self._mesh_context = store, mesh_context
        self.table: dict[tuple[Any, ...], jax.stages.Compiled] = {}
        self._stored: list[str] = []  # the store keys of the table's programs
        self.records: list[Record] = []  # each variant `ensure` made ready, in order

    def call(self, name: str, fn: jax.stages.Wrapped, args: Sequence[Any]) -> Any:
        if self.store is None:
            return fn(*args)
        key = table_key(name, args[2])
        program = self.table.get(key)
        if program is None:
            self.ensure([(name, fn, args)], lambda lowered: [p.compile() for p in lowered])
            program = self.table[key]
        return program(*args)

    def ensure(
        self, entries: Sequence[tuple[str, jax.stages.Wrapped, Sequence[Any]]], compile_all: Compile, threads: int = 1
    ) -> None:
        """Each (name, jit, args) made ready: read from the store (`threads` at a time), or
        traced, lowered and compiled (`compile_all` on all of those at once) and stored. Without
        a store each is compiled for its jit, which finds it when the variant first runs."""
        missing: list[tuple[tuple[Any, ...], str, str, _Timed]] = []
        wanted = {table_key(name, args[2]): (name, fn, args) for name, fn, args in entries}
        wanted = {key: entry for key, entry in wanted.items() if key not in self.table}
        store_keys = {key: self.store.key(name, args) if self.store else "" for key, (name, _, args) in wanted.items()}
        loaded = self._load(list(store_keys.values()), threads) if self.store is not None else {}
        for key, (name, fn, args) in wanted.items():
            program, seconds = loaded.get(store_keys[key], (None, 0.0))
            if program is not None:
                self.table[key] = program
                self._stored.append(store_keys[key])
                self._record(describe(name, args[2]), "store", seconds)
                continue
            with self._mesh_context():
                missing.append((key, store_keys[key], describe(name, args[2]), _Timed(fn.trace(*args).lower())))
        if missing:
            self._compile(missing, compile_all)
        if self.store is not None and wanted:
            self.store.remember(self._stored)

    def _compile(self, missing: list[tuple[tuple[Any, ...], str, str, _Timed]], compile_all: Compile) -> None:
        timed = [t for *_, t in missing]
        with fresh_compiles() if self.store is not None else contextlib.nullcontext():
            programs = compile_all(timed)  # type: ignore[arg-type]  # _Timed compiles as Lowered does
        for (key, store_key, variant, t), program in zip(missing, programs, strict=True):
            if self.store is not None:
                self.store.save(store_key, program)
                self.table[key] = program
                self._stored.append(store_key)
            self._record(variant, "compiled", t.seconds)

    def _load(self, keys: list[str], threads: int) -> dict[str, tuple[jax.stages.Compiled | None, float]]:
        """Each key's stored program (None where there is none) and the seconds it took."""
        assert self.store is not None
        store = self.store

        def load(key: str) -> tuple[jax.stages.Compiled | None, float]:
            start = time.perf_counter()
            return store.load(key), time.perf_counter() - start

        if threads <= 1 or len(keys) <= 1:
            return {key: load(key) for key in keys}
        with ThreadPoolExecutor(min(threads, len(keys)), thread_name_prefix="load") as pool:
            return dict(zip(keys, pool.map(load, keys), strict=True))

    def _record(self, variant: str, source: str, seconds: float) -> None:
        self.records.append(Record(variant, source, seconds))
        logger.info(
            "step variant %s: %s in %.2fs", variant, "read from the store" if source == "store" else source, seconds
        )

    def num_programs(self) -> int:
        return len(self.table)
