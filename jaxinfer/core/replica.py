"""Replica: the host state of one data replica, its KV cache manager and its Scheduler.

Without data parallelism the engine has one; with a mesh of data=N it has N, each scheduling its
own requests over its own KV pages (the engine sends a new request to the least loaded one). With
pipeline stages and a batch in flight on each (stage=S), it has S virtual replicas that take turns
(turns.py) over one KV cache manager whose freed pages wait for the batches in flight (kv/held.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from jaxinfer.config.kv_layout import KVLayout
from jaxinfer.config.scheduler import SchedulerConfig
from jaxinfer.core.scheduler import Scheduler
from jaxinfer.core.stops import StopChecker
from jaxinfer.core.turns import PipelineTurns, Turns
from jaxinfer.kv import KVCacheGroup, KVCacheManager, SwapCost, group_for
from jaxinfer.kv.held import HeldFreesManager
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
        *,
        kv_cache: KVCacheManager | None = None,
    ) -> Replica:
        """Replica `index`: a KV cache manager over `pool` (pages, page size, prefix caching, the
        model's KV layout, host-tier pages, swap cost model), or the `kv_cache` given, and its
        scheduler (seeded with config.seed + index); `adapter_slots` are every replica's."""
        kv_cache = kv_manager(pool) if kv_cache is None else kv_cache
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


def build_replicas(
    num_replicas: int,
    in_flight: int,
    pool: tuple[int, int, bool, KVLayout, int, SwapCost | None],
    *args: Any,
) -> tuple[list[Replica], Turns]:
    """The engine's replicas (Replica.build's other arguments in `args`) and how they take turns:
    `num_replicas` with pools of their own, all planning each step; or with `in_flight` > 1
    batches in flight (pipeline stages), that many virtual replicas over one manager holding
    freed pages for `in_flight` - 1 launches, one entering a batch per step (turns.py)."""
    if in_flight == 1:
        return [Replica.build(r, pool, *args) for r in range(num_replicas)], Turns()
    shared = kv_manager(pool, HeldFreesManager, delay=in_flight - 1)
    assert isinstance(shared, HeldFreesManager)  # for the type checker
    replicas = [Replica.build(r, pool, *args, kv_cache=shared) for r in range(in_flight)]
    for r in replicas[1:]:  # one page table and KV pool: sequence ids unique across them
        r.scheduler.seq_ids = replicas[0].scheduler.seq_ids
    return replicas, PipelineTurns(in_flight, shared)


def kv_manager(
    pool: tuple[int, int, bool, KVLayout, int, SwapCost | None], cls: type[KVCacheManager] = KVCacheManager, **more: Any
) -> KVCacheManager:
    """A KV cache manager over `pool` (Replica.build): of class `cls`, with `more` options."""
    num_pages, page_size, prefix_caching, layout, host_pages, swap_cost = pool
    options = dict(enable_prefix_caching=prefix_caching, groups=kv_groups(layout), host_pages=host_pages, **more)
    kv_cache = cls(num_pages, page_size, **options)
    kv_cache.swap_cost = swap_cost
    return kv_cache


def kv_groups(layout: KVLayout, margin: int = 0) -> list[KVCacheGroup]:
    """The KV cache manager's group for each group of the model's KV layout; `margin` widens
    each window (a drafter recomputes up to that many tokens it had computed)."""
    return [group_for(w, margin) for w in layout.windows]


def replica_stats(replicas: Sequence[Replica], lora: LoraManager | None = None) -> dict:
    """Sequences and KV pages summed over the replicas (Engine.stats); with LoRA, the sequences
    running and waiting under each adapter, and the adapters known, on the device, loaded so far."""
    caches = list({id(r.kv_cache): r.kv_cache for r in replicas}.values())  # virtual replicas share one
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
