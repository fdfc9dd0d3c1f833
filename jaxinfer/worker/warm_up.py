"""The step variants a worker compiles before its first request, and their compiles in parallel.

`step_variants` lists every variant of the step and the decode window as (all-padding inputs,
steps, greedy), in the order the worker's warm-up runs them: each token bucket with and without
a penalty history and prompt logprobs, the verify step of speculative decoding, each decode-sized
bucket's window and greedy twin.

`compile_all` compiles lowered programs on a pool of threads. XLA's compile, and a read from
JAX's persistent cache, release the GIL, so a machine with many cores builds the variants side by
side instead of one after another (a TPU host has dozens of cores and an engine tens of
variants). GPUs compile one after another unless $JAXINFER_COMPILE_THREADS says otherwise
(`compile_threads`). Each program was traced and lowered on the calling thread first, as the
jitted call would trace it: when the compiled step then executes each variant once, the jit finds the
executable compiled here and compiles nothing again (tests/jaxinfer/test_warm_up.py counts
backend compiles and persistent-cache reads).

`enable_compilation_cache` points JAX's persistent cache, which is one per process, at the
directory an engine's config names ("auto": $JAXINFER_COMPILATION_CACHE_DIR, else
~/.cache/jaxinfer/xla), so that later start-ups read the variants instead of compiling them.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

from jaxinfer.config import EngineConfig
from jaxinfer.config.caches import cache_path
from jaxinfer.config.compile import CACHE_DIR_VAR, DEFAULT_CACHE_DIR, MAX_COMPILE_THREADS, THREADS_VAR
from jaxinfer.worker.inputs import InputBuilder
from jaxinfer.worker.step_inputs import StepInputs
from jaxinfer.worker.step_variants import plain_padding, with_adapters

SERIAL_PLATFORMS = ("gpu", "cuda", "rocm")


def compilation_cache_path(directory: str | None) -> Path | None:
    """The persistent cache's directory for EngineConfig.compilation_cache_dir: "auto" is
    $JAXINFER_COMPILATION_CACHE_DIR where that is set, else ~/.cache/jaxinfer/xla; None, "" or
    "none" (in either) is no persistent cache."""
    return cache_path(directory, CACHE_DIR_VAR, DEFAULT_CACHE_DIR)


def enable_compilation_cache(directory: str | None) -> None:
    """Points JAX's persistent compilation cache at `directory` (compilation_cache_path), or
    turns it off. JAX keeps one cache a process and reads its directory once, at the first
    compile: a directory other than the one in use resets it, so that each engine's variants go
    where its config says, not where an earlier engine's went."""
    path = compilation_cache_path(directory)
    if path is not None:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(
                f"compilation_cache_dir={directory!r}: cannot create {str(path)!r} ({e.strerror or e})"
            ) from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"compilation_cache_dir={directory!r}: {str(path)!r} is not writable")
    wanted = None if path is None else str(path)
    if jax.config.jax_compilation_cache_dir != wanted:
        jax.config.update("jax_compilation_cache_dir", wanted)
        compilation_cache.reset_cache()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def compile_threads(num_programs: int, platform: str = "cpu") -> int:
    """Threads for `num_programs` compiles for `platform` ("cpu", "tpu", "gpu", ...): as many as
    $JAXINFER_COMPILE_THREADS says, else one per core (at most MAX_COMPILE_THREADS), but one on
    GPUs: there XLA times candidate kernels on the device while it compiles, and compiles side
    by side would time them against each other (not yet measured on a GPU)."""
    setting = os.environ.get(THREADS_VAR, "").strip()
    if setting:
        if not setting.isdigit() or int(setting) < 1:
            raise ValueError(f"{THREADS_VAR}={setting!r}: expected a whole number of threads >= 1")
        return max(1, min(num_programs, int(setting)))
    if platform in SERIAL_PLATFORMS:
        return 1
    return max(1, min(num_programs, os.cpu_count() or 1, MAX_COMPILE_THREADS))


def compile_all(
    lowered: list[jax.stages.Lowered], platform: str = "cpu", threads: int | None = None
) -> list[jax.stages.Compiled]:
    """Each program compiled (or read from the persistent cache), `threads` (default:
    `compile_threads`) at a time; the first error is raised once all have finished."""
    threads = compile_threads(len(lowered), platform) if threads is None else threads
    if threads == 1:
        return [program.compile() for program in lowered]
    with ThreadPoolExecutor(threads, thread_name_prefix="compile") as pool:
        return list(pool.map(lambda program: program.compile(), lowered))


class CompiledVariants(Protocol):
    """What warm-up reads of a CompiledStep (compiled_step.py imports this module)."""

    engine: EngineConfig
    inputs: InputBuilder
    buckets: tuple[int, ...]
    window_buckets: tuple[int, ...]
    greedy_buckets: tuple[int, ...]
    num_decode_steps: int
    greedy_steps: int

    def padding_inputs(
        self, t_bucket: int, with_history: bool, spec: bool = False, prompt: bool = False, table_width: int = 0
    ) -> StepInputs[np.ndarray]: ...


def step_variants(step: CompiledVariants) -> list[tuple[StepInputs[np.ndarray], int, bool]]:
    """(padding inputs, num_steps, greedy) of each step and window variant of `step` (a
    CompiledStep), as `step.execute` takes them."""
    engine = step.engine
    variants = []
    for t_bucket in step.buckets:
        for with_history in (False, True) if engine.compile.penalties else (False,):
            for prompt in (False, True) if engine.compile.enable_prompt_logprobs else (False,):
                variants.append((step.padding_inputs(t_bucket, with_history, prompt=prompt), 1, False))
        if step.inputs.num_speculative_tokens:  # the verify variant (speculative decoding)
            variants.append((step.padding_inputs(t_bucket, False, spec=True), 1, True))
    variants += [
        (step.padding_inputs(t_bucket, False), step.num_decode_steps, False) for t_bucket in step.window_buckets
    ]
    # The greedy twin, on padding rows made plain (they qualify for it).
    variants += [
        (plain_padding(step.padding_inputs(t_bucket, False)), step.greedy_steps, True)
        for t_bucket in step.greedy_buckets
    ]
    if step.engine.lora.enable_lora and step.engine.lora.specialize_lora:  # each with the adapters' shares too
        variants += [(with_adapters(inputs), num_steps, greedy) for inputs, num_steps, greedy in variants]
    return variants
