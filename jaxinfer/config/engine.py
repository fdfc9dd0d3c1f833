"""EngineConfig: serving limits and the static shapes the jitted step is compiled for.

Validated when built, before any model is loaded: a bad value is named with what it may be.
"""
from __future__ import annotations

import dataclasses

from jaxinfer.config.speculative import SpeculativeConfig

# Start-up settings from the environment (read in jaxinfer/worker/warm_up.py; named here, free of JAX, for
# the CLI's help): the warm-up's compile threads, and where compilation_cache_dir="auto" points.
THREADS_VAR = "JAXINFER_COMPILE_THREADS"
MAX_COMPILE_THREADS = 16
CACHE_DIR_VAR = "JAXINFER_COMPILATION_CACHE_DIR"
DEFAULT_CACHE_DIR = "~/.cache/jaxinfer/xla"

# "auto" = the model dtype; int8 and fp8 (e4m3; "fp8_e4m3" is the same) store K/V with static
# per-head scales calibrated at start-up and hold 2x the pages of bfloat16 in the same bytes.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "float16", "int8", "fp8", "fp8_e4m3")
MAX_DECODE_STEPS = 64
DEFAULT_PAGE_SIZE = 16  # tokens per KV page where the TPU kernel's SMEM asks for nothing larger
REASONING_PARSERS = ("deepseek_r1", "qwen3")  # the formats of tokenizer/reasoning.py (a test checks)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Serving limits and the static shapes the jitted step is compiled for.

    Every step is padded to a token bucket T (and a sequence bucket S = min(T, max_num_seqs)).
    Each bucket compiles one step variant, plus one with a penalty history when `penalties` is on
    (requests with repetition/presence/frequency penalties need it), and each of those once more
    with `enable_prompt_logprobs`; all compile at start-up.
    The KV pool is `num_pages` pages of `page_size` tokens per layer, or as many as fit
    in `kv_cache_memory_fraction` of the device's free memory (`kv_cache_bytes` on the CPU).
    `mesh` ("data=2,tensor=4", a dict of axis sizes, or a jax Mesh from sharding.make_mesh)
    spreads the engine over devices; with data=N there are N replicas, each with its own
    scheduler and a pool of `num_pages` pages.

    Per-request limits (a request past them is refused with the field and the limit named):
    `max_n` samples, `max_request_tokens` of prompt + max_tokens (default: max_model_len), and
    `max_seqs_per_request` of its samples queued or running at once (the rest take turns).
    """

    # None: 16, or where the TPU kernel runs the smallest power of two whose page table fits its
    # SMEM (`with_page_size`), and 32 at least for one-byte caches there.
    page_size: int | None = None
    num_pages: int | None = None
    kv_cache_memory_fraction: float = 0.85
    kv_cache_bytes: int | None = None  # overrides the fraction; default on the CPU: 1 GiB
    kv_cache_dtype: str = "auto"  # "auto" = the model dtype; or bfloat16, float32, float16, int8, fp8
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_n: int = 64
    max_request_tokens: int | None = None
    max_seqs_per_request: int = 16
    token_buckets: tuple[int, ...] | None = None  # default: 1, 2, 4, ... up to the budget
    penalties: bool = True  # False: one variant fewer per bucket; penalty requests are rejected
    enable_prefix_caching: bool = True
    async_scheduling: bool = True  # plan step N+1 while step N runs; False: the synchronous loop
    # Decode windows: when every running sequence decodes, run this many steps per jitted call
    # (sampler inside; the host checks stops afterwards). None: 8 (1 with data replicas).
    num_decode_steps: int | None = None
    # Structured output: compile the step split in two, so a grammar's mask for step N+1 is
    # filled while the device runs step N+1's forward (after step N's tokens land) instead of
    # before it is dispatched. None: on accelerators only.
    structured_output_overlap: bool | None = None
    # Compile each decode-sized bucket's decode step (the window) once more for batches whose
    # every row is greedy and asks for nothing else (no logprobs, bias, grammar or penalty): it
    # runs no conditional, each of which holds XLA:GPU's host until the device reaches it.
    # None: on GPUs only.
    greedy_variant: bool | None = None
    # Launch each step from a thread of its own (launcher.py): on XLA:GPU a step's conditionals
    # hold the launching thread until the device reaches them. None: on GPUs only.
    dispatch_thread: bool | None = None
    # On the CPU, large freed host blocks stay in the heap for the next step (host_memory.py:
    # the process's glibc allocator, set once the weights are placed). False: glibc's defaults.
    cpu_heap_reuse: bool = True
    attn_impl: str = "auto"
    # JAX's persistent compilation cache (warm_up.compilation_cache_path): "auto" is
    # $JAXINFER_COMPILATION_CACHE_DIR, else ~/.cache/jaxinfer/xla; a directory; None or "none": off.
    compilation_cache_dir: str | None = "auto"
    seed: int = 0
    mesh: "str | dict | object | None" = None  # None: one device
    # Speculative decoding (spec_config.py): a dict such as {"method": "ngram",
    # "num_speculative_tokens": 4}, its JSON text, or a SpeculativeConfig. None: off.
    speculative_config: "SpeculativeConfig | dict | str | None" = None
    # A reasoning model's format ("qwen3", "deepseek_r1"; tokenizer/reasoning.py): structured
    # output then constrains the answer after `</think>`, not the thinking. None: the whole output.
    reasoning_parser: str | None = None
    # Prompt logprobs (SamplingParams.prompt_logprobs): compile each bucket's step once more,
    # with the LM head over every row of the batch. Off: requests asking for them are refused.
    enable_prompt_logprobs: bool = False

    def __post_init__(self):
        def positive(name):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")

        for name in ("page_size", "num_pages", "kv_cache_bytes", "max_model_len",
                     "max_num_batched_tokens", "max_num_seqs", "max_n", "max_request_tokens",
                     "max_seqs_per_request", "num_decode_steps"):
            positive(name)
        if self.num_decode_steps is not None and self.num_decode_steps > MAX_DECODE_STEPS:
            raise ValueError(f"EngineConfig.num_decode_steps must be at most {MAX_DECODE_STEPS}, "
                             f"got {self.num_decode_steps}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"EngineConfig.num_pages must be at least 2 (page 0 is reserved), got {self.num_pages}")
        from pallas_kernels.dispatch import IMPLS  # imports jax: only when an engine is configured

        if self.attn_impl not in IMPLS:
            raise ValueError(f"EngineConfig.attn_impl={self.attn_impl!r}: expected one of {IMPLS}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"EngineConfig.kv_cache_dtype={self.kv_cache_dtype!r}: expected one of {KV_CACHE_DTYPES}")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(
                f"EngineConfig.kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"EngineConfig.reasoning_parser={self.reasoning_parser!r}: expected one of "
                             f"{REASONING_PARSERS} or None")
        if self.compilation_cache_dir is not None and not isinstance(self.compilation_cache_dir, str):
            raise ValueError(f"EngineConfig.compilation_cache_dir must be a directory, \"auto\" or None, "
                             f"got {self.compilation_cache_dir!r}")
        if not isinstance(self.enable_prompt_logprobs, bool):
            raise ValueError(f"EngineConfig.enable_prompt_logprobs must be a bool, got {self.enable_prompt_logprobs!r}")
        if self.enable_prompt_logprobs and self.speculative_config is not None:
            raise ValueError("EngineConfig.enable_prompt_logprobs=True: not supported together with "
                             "speculative decoding (speculative_config)")
        if isinstance(self.mesh, (str, dict)):
            from sharding.mesh import format_mesh, parse_mesh_spec  # imports jax: only when asked for

            object.__setattr__(self, "mesh", format_mesh(parse_mesh_spec(self.mesh)))
        if self.token_buckets is not None:
            buckets = tuple(self.token_buckets)
            if not buckets or any(not isinstance(b, int) or b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
                raise ValueError(f"EngineConfig.token_buckets must be increasing positive integers, got {buckets!r}")
            if buckets[-1] < self.max_num_batched_tokens:
                raise ValueError(
                    f"EngineConfig.token_buckets {buckets!r} must reach max_num_batched_tokens="
                    f"{self.max_num_batched_tokens}")

    def check_params(self, params) -> None:
        """ValueError naming what of a request's SamplingParams this engine was not started for."""
        if params.uses_penalties and not self.penalties:
            raise ValueError("repetition/presence/frequency penalties are off in this engine "
                             "(EngineConfig.penalties=False); start it with penalties on")
        if params.n > self.max_n:
            raise ValueError(f"SamplingParams.n={params.n} exceeds this engine's max_n={self.max_n}")
        if params.prompt_logprobs is not None and not self.enable_prompt_logprobs:
            raise ValueError(f"SamplingParams.prompt_logprobs={params.prompt_logprobs}: this engine was "
                             "started without prompt logprobs (EngineConfig.enable_prompt_logprobs, "
                             "--enable-prompt-logprobs)")

    def buckets(self) -> tuple[int, ...]:
        """Token buckets: the given ones, or powers of two up to max_num_batched_tokens.

        Coarser steps compile fewer variants but pad more: with powers of four a 32-sequence
        decode ran in the 64-token bucket at 0.55x HF's speed on the CPU instead of 0.7x.
        """
        if self.token_buckets is not None:
            return tuple(self.token_buckets)
        out, b = [], 1
        while b < self.max_num_batched_tokens:
            out.append(b)
            b *= 2
        return tuple(out + [self.max_num_batched_tokens])

    def seq_bucket(self, token_bucket: int) -> int:
        return min(token_bucket, self.max_num_seqs)

    def with_page_size(self, max_model_len: int) -> EngineConfig:
        """This config with `page_size` chosen where it is None: 16; where the TPU kernel runs
        (`attn_impl` pallas_tpu, or auto on a TPU), the smallest power of two from 16 (32 for
        one-byte caches) whose page table of `max_num_seqs` sequences of `max_model_len` tokens
        fits in the kernel's SMEM (pallas_kernels.tpu_config.table_page_size)."""
        if self.page_size is not None:
            return self
        from pallas_kernels.dispatch import resolve_impl
        from pallas_kernels.tpu_config import table_page_size

        page = DEFAULT_PAGE_SIZE
        if resolve_impl(self.attn_impl) == "pallas_tpu":
            least = 32 if self.kv_cache_dtype in ("int8", "fp8", "fp8_e4m3") else DEFAULT_PAGE_SIZE
            page = table_page_size(self.max_num_seqs, max_model_len, least)
        return dataclasses.replace(self, page_size=page)
