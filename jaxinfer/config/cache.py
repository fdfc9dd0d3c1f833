"""CacheConfig: the paged KV cache -- page size, how many pages, their dtype, prefix caching."""

from __future__ import annotations

import dataclasses

from jaxinfer.config.checks import bools, one_of, positive_ints
from jaxinfer.options import DISABLE, option

# "auto" = the model dtype; int8 and fp8 (e4m3; "fp8_e4m3" is the same) store K/V with static
# per-head scales calibrated at start-up and hold 2x the pages of bfloat16 in the same bytes.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "float16", "int8", "fp8", "fp8_e4m3")
DEFAULT_PAGE_SIZE = 16  # tokens per KV page where the TPU kernel's SMEM asks for nothing larger


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The KV pool is `num_pages` pages of `page_size` tokens per layer, or as many as fit in
    `kv_cache_memory_fraction` of the device's free memory (`kv_cache_bytes` on the CPU)."""

    TITLE = "KV cache"

    # None: 16, or where the TPU kernel runs the smallest power of two whose page table fits its
    # SMEM (EngineConfig.with_page_size), and 32 at least for one-byte caches there.
    page_size: int | None = option(
        None,
        "tokens per KV cache page (default 16; on a TPU, larger where the page table would not fit the kernel's SMEM)",
    )
    num_pages: int | None = option(None, "KV cache pages (default: from memory)")
    kv_cache_memory_fraction: float = option(0.85, "fraction of free accelerator memory for the KV cache")
    kv_cache_bytes: int | None = option(
        None, "bytes of KV cache per device, instead of a fraction of its free memory (default on the CPU: 1 GiB)"
    )
    kv_cache_dtype: str = option(
        "auto",
        "auto (= the model dtype), bfloat16, float32, float16, int8 or fp8 (e4m3; int8/fp8: per-head "
        "scales calibrated at start-up, 2x the pages of bfloat16)",
    )
    enable_prefix_caching: bool = option(
        True, "disable automatic prefix caching", form=DISABLE, flag="--no-prefix-caching"
    )
    kv_offload_gb: float = option(
        0.0,
        "GiB of host memory per data replica for KV pages evicted from the device: a prefix hit on "
        "them copies them back instead of computing them again, and a preempted sequence's pages are "
        "swapped there where that is measured cheaper than recomputing them (0: off)",
    )

    def __post_init__(self):
        positive_ints(self, "page_size", "num_pages", "kv_cache_bytes")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"EngineConfig.num_pages must be at least 2 (page 0 is reserved), got {self.num_pages}")
        one_of(self, "kv_cache_dtype", KV_CACHE_DTYPES)
        fraction = self.kv_cache_memory_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"EngineConfig.kv_cache_memory_fraction must be in (0, 1], got {fraction}")
        bools(self, "enable_prefix_caching")
        gb = self.kv_offload_gb
        if isinstance(gb, bool) or not isinstance(gb, (int, float)) or not 0 <= gb < float("inf"):
            raise ValueError(f"EngineConfig.kv_offload_gb must be a number of GiB >= 0, got {gb!r}")

    @property
    def chosen_page_size(self) -> int:
        """`page_size` once chosen (EngineConfig.with_page_size; the engine's config has it)."""
        if self.page_size is None:
            raise ValueError("EngineConfig.page_size is not chosen yet: EngineConfig.with_page_size chooses it")
        return self.page_size

    @property
    def one_byte(self) -> bool:
        return self.kv_cache_dtype in ("int8", "fp8", "fp8_e4m3")
