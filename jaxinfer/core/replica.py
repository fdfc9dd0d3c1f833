"""Replica: the host state of one data replica, its KV cache manager and its Scheduler.

Without data parallelism the engine has one; with a mesh of data=N it has N, each scheduling its
own requests over its own KV pages (the engine sends a new request to the least loaded one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from jaxinfer.config.kv_layout import KVLayout
from jaxinfer.config.scheduler import SchedulerConfig
from jaxinfer.core.scheduler import Scheduler
from jaxinfer.core.stops import StopChecker
from jaxinfer.kv import KVCacheGroup, KVCacheManager, SwapCost, group_for
from jaxinfer.lora.manager import LoraManager
from jaxinfer.lora.slots import AdapterSlots


@dataclasses.dataclass
class Replica:
    kv_cache: KVCacheManager
    scheduler: Scheduler
    load: int = 0  # cost of its unfinished requests

    @classmethod
    def build(
        cls,
        index: int,
        pool: tuple[int, int, bool, KVLayout, int, SwapCost | None],
        config: SchedulerConfig,
        max_model_len: int,
        eos_token_ids: Iterable[int],
        stop_checker: StopChecker | None,
        adapter_slots: AdapterSlots | None,
    ) -> Replica:
        """Replica `index`: a KV cache manager over `pool` (pages, page size, prefix caching, the
        model's KV layout, host-tier pages, swap cost model) and its scheduler (seeded with config.seed + index);
        `adapter_slots` are every replica's."""
        num_pages, page_size, prefix_caching, layout, host_pages, swap_cost = pool
        groups = kv_groups(layout)
        kv_cache = KVCacheManager(
            num_pages, page_size, enable_prefix_caching=prefix_caching, groups=groups, host_pages=host_pages
        )
        kv_cache.swap_cost = swap_cost
        scheduler = Scheduler(
            kv_cache,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=max_model_len,
            eos_token_ids=eos_token_ids,
            seed=config.seed + index,
            stop_checker=stop_checker,
            max_seqs_per_request=config.max_seqs_per_request,
            adapter_slots=adapter_slots,
        )
        return cls(kv_cache, scheduler)


def kv_groups(layout: KVLayout, margin: int = 0) -> list[KVCacheGroup]:
    """The KV cache manager's group for each group of the model's KV layout; `margin` widens
    each window (a drafter recomputes up to that many tokens it had computed)."""
    return [group_for(w, margin) for w in layout.windows]


def replica_stats(replicas: Sequence[Replica], lora: LoraManager | None = None) -> dict:
    """Sequences and KV pages summed over the replicas (Engine.stats); with LoRA, the sequences
    running and waiting under each adapter, and the adapters known, on the device, loaded so far."""
    caches = [r.kv_cache for r in replicas]
    total, free = sum(c.num_usable_pages for c in caches), sum(c.num_free_pages for c in caches)
    queries = sum(c.prefix_cache_queries for c in caches)
    return {
        "running": sum(r.scheduler.num_running for r in replicas),
        "waiting": sum(r.scheduler.num_waiting for r in replicas),
        "kv_pages_total": total,
        "kv_pages_free": free,
        "kv_cache_usage": 1.0 - free / total,
        "prefix_cache_hit_rate": sum(c.prefix_cache_hits for c in caches) / queries if queries else 0.0,
        **(_host_stats(caches, queries) if caches[0].host is not None else {}),
        **(_lora_stats(replicas, lora) if lora is not None else {}),
    }


def _host_stats(caches: Sequence[KVCacheManager], queries: int) -> dict:
    """The host tier (kv_offload_gb) over the replicas: its pages, those in use (those held for
    swapped sequences among them), the prompt tokens it served and their share of those looked
    up, the preemptions that swapped pages out."""
    hosts = [c.host for c in caches if c.host is not None]
    host_hits = sum(c.pool.prefix_cache_host_hits for c in caches)
    return {
        "kv_host_pages_total": sum(h.num_slots for h in hosts),
        "kv_host_pages_used": sum(h.num_used for h in hosts),
        "kv_host_pages_swapped": sum(h.num_swapped for h in hosts),
        "preemptions_swapped": sum(c.num_swapped_preemptions for c in caches),
        "prefix_cache_host_hits": host_hits,
        "prefix_cache_host_hit_rate": host_hits / queries if queries else 0.0,
    }


def _lora_stats(replicas: Sequence[Replica], lora: LoraManager) -> dict:
    names = [e.name for e in lora.adapters]
    running, waiting = dict.fromkeys(names, 0), dict.fromkeys(names, 0)
    for r in replicas:
        for counts, seqs in ((running, r.scheduler.running), (waiting, r.scheduler.waiting)):
            for seq in seqs:
                if seq.adapter is not None:
                    counts[seq.adapter] = counts.get(seq.adapter, 0) + 1
    return {
        "lora_running": running,
        "lora_waiting": waiting,
        "lora_adapters": len(names),
        "lora_adapters_on_device": len(lora.slots.loaded),
        "lora_loads": lora.num_loads,
    }
