"""Replica: the host state of one data replica, its KV cache manager and its Scheduler.

Without data parallelism the engine has one; with a mesh of data=N it has N, each scheduling its
own requests over its own KV pages (the engine sends a new request to the least loaded one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxinfer.core.scheduler import Scheduler
from jaxinfer.kv import KVCacheManager


@dataclasses.dataclass
class Replica:
    kv_cache: KVCacheManager
    scheduler: Scheduler
    load: int = 0  # cost of its unfinished requests


def replica_stats(replicas: Sequence[Replica]) -> dict:
    """Sequences and KV pages summed over the replicas (Engine.stats)."""
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
    }
