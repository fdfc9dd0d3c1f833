"""CompileConfig: which step variants are compiled, how steps launch, and where compiles are kept."""

from __future__ import annotations

import dataclasses

from jaxinfer.config.checks import bools
from jaxinfer.options import CSV, DISABLE, ENABLE, TRISTATE, option

# Start-up settings from the environment (read in jaxinfer/worker/warm_up.py; named here, free of
# JAX, for the CLI's help): the warm-up's compile threads, and where compilation_cache_dir="auto"
# points.
THREADS_VAR = "JAXINFER_COMPILE_THREADS"
MAX_COMPILE_THREADS = 16
CACHE_DIR_VAR = "JAXINFER_COMPILATION_CACHE_DIR"
DEFAULT_CACHE_DIR = "~/.cache/jaxinfer/xla"
EXECUTABLES_DIR_VAR = "JAXINFER_EXECUTABLE_CACHE_DIR"
DEFAULT_EXECUTABLES_DIR = "~/.cache/jaxinfer/executables"
ATTN_IMPLS = ("auto", "reference", "pallas_gpu", "pallas_tpu")  # pallas_kernels.dispatch.IMPLS (a test checks)


@dataclasses.dataclass(frozen=True)
class CompileConfig:
    """Each token bucket compiles one step variant, plus one with a penalty history when
    `penalties` is on (requests with repetition/presence/frequency penalties need it), and each
    of those once more with `enable_prompt_logprobs`; all compile at start-up."""

    TITLE = "compilation and the step loop"

    token_buckets: tuple[int, ...] | None = option(
        None, "comma-separated step sizes to compile (default: powers of two up to the budget)", form=CSV
    )
    # False: one variant fewer per bucket; penalty requests are rejected.
    penalties: bool = option(
        True,
        "compile no penalty variants (faster start); penalty requests are refused",
        form=DISABLE,
        flag="--no-penalties",
    )
    # Prompt logprobs (SamplingParams.prompt_logprobs): compile each bucket's step once more, with
    # the LM head over every row of the batch. Off: requests asking for them are refused.
    enable_prompt_logprobs: bool = option(
        False,
        "compile the steps that score prompts (one more variant per token bucket), so requests may ask "
        "for prompt logprobs",
        form=ENABLE,
    )
    # Structured output: compile the step split in two, so a grammar's mask for step N+1 is
    # filled while the device runs step N+1's forward (after step N's tokens land) instead of
    # before it is dispatched. None: on accelerators only.
    structured_output_overlap: bool | None = option(
        None,
        "fill grammar masks while the step's forward runs (a split step; auto: on accelerators only)",
        form=TRISTATE,
    )
    # Compile each decode-sized bucket's decode step (the window) once more for batches whose
    # every row is greedy and asks for nothing else (no logprobs, bias, grammar or penalty): it
    # runs no conditional, each of which holds XLA:GPU's host until the device reaches it.
    # None: on GPUs only.
    greedy_variant: bool | None = option(
        None,
        "compile each decode step once more for all-greedy batches, with no conditional (each holds the "
        "host on a GPU); auto: on GPUs only",
        form=TRISTATE,
    )
    # Launch each step from a thread of its own (worker/launcher.py): on XLA:GPU a step's
    # conditionals hold the launching thread until the device reaches them. None: on GPUs only.
    dispatch_thread: bool | None = option(
        None,
        "launch each step from a thread of its own, so the loop plans the next step while a step's "
        "conditionals hold the launch (auto: on GPUs only)",
        form=TRISTATE,
    )
    # On the CPU, large freed host blocks stay in the heap for the next step (worker/host_memory.py:
    # the process's glibc allocator, set once the weights are placed). False: glibc's defaults.
    cpu_heap_reuse: bool = option(
        True,
        "on the CPU, let glibc unmap large freed blocks (its default) instead of keeping them for the "
        "next step's temporaries",
        form=DISABLE,
        flag="--no-cpu-heap-reuse",
    )
    attn_impl: str = option(
        "auto",
        "the attention kernel: auto picks by backend (pallas_tpu on TPUs, pallas_gpu on GPUs, the "
        "pure-JAX reference on the CPU)",
        choices=ATTN_IMPLS,
    )
    # Background compilation (worker/background.py): the smallest token bucket's variants compile
    # before the engine serves, the rest while it serves, smallest first; the schedulers plan within
    # the buckets ready so far. Off: everything compiles first (nothing compiles after warm-up).
    compile_in_background: bool = option(
        False,
        "serve once a first request's token buckets (the smallest, one holding a chat prompt) are "
        "compiled and compile the rest while serving (batches wait for their bucket); off: "
        "everything compiles before the first request",
        form=ENABLE,
    )
    # JAX's persistent compilation cache (worker/warm_up.compilation_cache_path): "auto" is
    # $JAXINFER_COMPILATION_CACHE_DIR, else ~/.cache/jaxinfer/xla; a directory; None or "none": off.
    compilation_cache_dir: str | None = option(
        "auto",
        "JAX's persistent compilation cache, so later start-ups read the compiled step variants: a "
        "directory, or none; auto: $JAXINFER_COMPILATION_CACHE_DIR, else ~/.cache/jaxinfer/xla",
        metavar="DIR",
    )
    # Compiled step variants kept whole (worker/executables.py): a warm start loads each without
    # tracing, lowering or compiling. "auto": $JAXINFER_EXECUTABLE_CACHE_DIR, else
    # ~/.cache/jaxinfer/executables; its weights/ folder keeps GGUF models' prepared weights
    # (jaxinfer/prepared_weights.py). None or "none": off (the step goes through the jit, and JAX's
    # persistent cache alone). Off with several processes.
    executable_cache_dir: str | None = option(
        "auto",
        "compiled step variants kept whole, so a warm start loads them without tracing, lowering or "
        "compiling, and a GGUF model's prepared weights (in its weights folder): a directory, or none; "
        "auto: $JAXINFER_EXECUTABLE_CACHE_DIR, else ~/.cache/jaxinfer/executables",
        metavar="DIR",
    )

    def __post_init__(self):
        if self.token_buckets is not None:
            buckets = tuple(self.token_buckets) if isinstance(self.token_buckets, (list, tuple)) else None
            if (
                not buckets
                or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in buckets)
                or list(buckets) != sorted(set(buckets))
            ):
                raise ValueError(
                    f"EngineConfig.token_buckets must be increasing positive integers, got {self.token_buckets!r}"
                )
            object.__setattr__(self, "token_buckets", buckets)
        bools(self, "penalties", "enable_prompt_logprobs", "cpu_heap_reuse", "compile_in_background")
        bools(self, "structured_output_overlap", "greedy_variant", "dispatch_thread", optional=True)
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"EngineConfig.attn_impl={self.attn_impl!r}: expected one of {ATTN_IMPLS}")
        for name in ("compilation_cache_dir", "executable_cache_dir"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f'EngineConfig.{name} must be a directory, "auto" or None, got {value!r}')
