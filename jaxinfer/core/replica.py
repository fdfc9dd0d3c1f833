"""Replica: the host state of one data replica, its KV PagePool and its Scheduler.

Without data parallelism the engine has one; with a mesh of data=N it has N, each scheduling its
own requests over its own pool (the engine sends a new request to the least loaded one).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from jaxinfer.core.paging import PagePool
from jaxinfer.core.scheduler import Scheduler


@dataclasses.dataclass
class Replica:
    pool: PagePool
    scheduler: Scheduler
    load: int = 0  # cost of its unfinished requests


def replica_stats(replicas: Sequence[Replica]) -> dict:
    """Sequences and KV pages summed over the replicas (Engine.stats)."""
    pools = [r.pool for r in replicas]
    total, free = sum(p.num_usable_pages for p in pools), sum(p.num_free_pages for p in pools)
    queries = sum(p.prefix_cache_queries for p in pools)
    return {
        "running": sum(r.scheduler.num_running for r in replicas),
        "waiting": sum(r.scheduler.num_waiting for r in replicas),
        "kv_pages_total": total, "kv_pages_free": free, "kv_cache_usage": 1.0 - free / total,
        "prefix_cache_hit_rate": sum(p.prefix_cache_hits for p in pools) / queries if queries else 0.0,
    }
