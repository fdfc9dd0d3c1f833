"""EngineConfig: an engine's whole configuration, in typed groups, built from flat options.

    EngineConfig(max_num_seqs=32, page_size=16, mesh="tensor=4")  # any option of any group
    config.scheduler.max_num_seqs, config.cache.page_size, config.parallel.mesh

Each group (load.py, cache.py, scheduler.py, compile.py, parallel.py, lora.py, kv_transfer.py)
declares its options once, as fields carrying their help text, choices and command-line form (jaxinfer/options.py); the
option names are unique across groups, so `EngineConfig(**options)`, `LLM(**options)` and the
command line's flags all take the same flat names and are generated from the same fields
(`EngineConfig.declared()`). Each group validates its own fields when built; what spans groups is
checked here. A bad value is named with what it may be, before any model is loaded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from jaxinfer.config.cache import CacheConfig
from jaxinfer.config.compile import CompileConfig
from jaxinfer.config.kv_transfer import KVTransferConfig
from jaxinfer.config.load import LoadConfig
from jaxinfer.config.lora import LoraConfig
from jaxinfer.config.parallel import ParallelConfig
from jaxinfer.config.scheduler import SchedulerConfig
from jaxinfer.config.speculative import SpeculativeConfig
from jaxinfer.options import JSON, Declared, declared, option

GROUPS: dict[str, Any] = {  # the group classes, each with a TITLE
    "load": LoadConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "compile": CompileConfig,
    "parallel": ParallelConfig,
    "lora": LoraConfig,
    "kv_transfer": KVTransferConfig,
}
SPECULATIVE_TITLE = "speculative decoding"


@dataclasses.dataclass(frozen=True, init=False)
class EngineConfig:
    load: LoadConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    compile: CompileConfig
    parallel: ParallelConfig
    lora: LoraConfig
    kv_transfer: KVTransferConfig
    # Speculative decoding (config/speculative.py): a dict such as {"method": "ngram",
    # "num_speculative_tokens": 4}, its JSON text, or a SpeculativeConfig. None: off.
    speculative_config: SpeculativeConfig | None = option(
        None,
        'speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
        '(prompt_lookup_max / _min: the n-gram sizes looked up) or \'{"method": "draft_model", "model": '
        'PATH, "num_speculative_tokens": 4}\'',
        form=JSON,
        metavar="JSON",
        group=SPECULATIVE_TITLE,
    )

    def __init__(self, **options: Any):
        unknown = sorted(set(options) - set(OPTION_GROUPS))
        if unknown:
            raise TypeError(f"EngineConfig: unknown option {unknown[0]!r} (options: {', '.join(OPTION_GROUPS)})")
        for attr, cls in GROUPS.items():
            names = [d.name for d in declared(cls)]
            object.__setattr__(self, attr, cls(**{n: options[n] for n in names if n in options}))
        spec = SpeculativeConfig.parse(options.get("speculative_config"))
        object.__setattr__(self, "speculative_config", spec)
        self._check_across_groups()

    def _check_across_groups(self) -> None:
        buckets = self.compile.token_buckets
        if buckets is not None and buckets[-1] < self.scheduler.max_num_batched_tokens:
            raise ValueError(
                f"EngineConfig.token_buckets {buckets!r} must reach max_num_batched_tokens="
                f"{self.scheduler.max_num_batched_tokens}"
            )
        if self.compile.enable_prompt_logprobs and self.speculative_config is not None:
            raise ValueError(
                "EngineConfig.enable_prompt_logprobs=True: not supported together with "
                "speculative decoding (speculative_config)"
            )

    @staticmethod
    def declared() -> Iterator[tuple[str, Declared]]:
        """(help section title, option) of every option, group by group, in declaration order."""
        for cls in GROUPS.values():
            for d in declared(cls):
                yield d.option.group or cls.TITLE, d
        for d in declared(EngineConfig):
            yield d.option.group or "", d

    def options(self) -> dict[str, Any]:
        """Every option's value by its flat name (as EngineConfig(**options) takes them back)."""
        out = {}
        for attr in GROUPS:
            group = getattr(self, attr)
            out.update({d.name: getattr(group, d.name) for d in declared(type(group))})
        out["speculative_config"] = self.speculative_config
        return out

    def replace(self, **changes: Any) -> EngineConfig:
        """This config with some options changed, checked again."""
        return EngineConfig(**{**self.options(), **changes})

    def buckets(self) -> tuple[int, ...]:
        """Token buckets: the given ones, or powers of two up to max_num_batched_tokens.

        Coarser steps compile fewer variants but pad more: with powers of four a 32-sequence
        decode ran in the 64-token bucket at 0.55x HF's speed on the CPU instead of 0.7x.
        """
        if self.compile.token_buckets is not None:
            return self.compile.token_buckets
        budget = self.scheduler.max_num_batched_tokens
        out, b = [], 1
        while b < budget:
            out.append(b)
            b *= 2
        return tuple(out + [budget])

    def seq_bucket(self, token_bucket: int) -> int:
        return min(token_bucket, self.scheduler.max_num_seqs)

    def with_page_size(self, max_model_len: int) -> EngineConfig:
        """This config with `page_size` chosen where it is None: 16; where the TPU kernel runs
        (`attn_impl` pallas_tpu, or auto on a TPU), the smallest power of two from 16 (32 for
        one-byte caches) whose page table of `max_num_seqs` sequences of `max_model_len` tokens
        fits in the kernel's SMEM (pallas_kernels.tpu_config.table_page_size)."""
        if self.cache.page_size is not None:
            return self
        from jaxinfer.config.cache import DEFAULT_PAGE_SIZE
        from pallas_kernels.dispatch import resolve_impl  # imports jax: only when an engine is built
        from pallas_kernels.tpu_config import table_page_size

        page = DEFAULT_PAGE_SIZE
        if resolve_impl(self.compile.attn_impl) == "pallas_tpu":
            least = 32 if self.cache.one_byte else DEFAULT_PAGE_SIZE
            page = table_page_size(self.scheduler.max_num_seqs, max_model_len, least)
        return self.replace(page_size=page)


# option name -> the attribute of EngineConfig that holds it ("" for top-level options)
OPTION_GROUPS = {d.name: attr for attr, cls in GROUPS.items() for d in declared(cls)}
OPTION_GROUPS["speculative_config"] = ""
