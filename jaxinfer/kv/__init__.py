"""The KV cache manager: which pages hold which sequence's tokens (plain Python, no JAX).

    manager.py       KVCacheManager: the scheduler's interface (computed prefix, allocate, cache,
                     truncate, free, fork with copy-on-write, metrics, events), a page table per
                     layer group
    prefix.py        a prefix hit: the longest prefix every group holds, taken at admission
    host_tier.py     HostTier: cached pages evicted from the device kept in host memory
    swap.py          a preempted sequence's pages swapped to the host tier and back, and the
                     measured cost model that decides whether to
    tables.py        one page table's edits (copy-on-write, a sliding window's pages given back)
    page_pool.py     PagePool: free list in eviction order, reference counts, the null page 0,
                     a prefix cache per layer group
    prefix_cache.py  the chained page hash and the map from hashes to cached pages
    groups.py        KV cache groups: full attention, sliding window
    events.py        BlockStored / BlockRemoved / AllBlocksCleared for routers

The worker holds the pages' arrays; it only ever sees page ids in a plan's page tables, and
imports NULL_PAGE from here. Nothing here imports the rest of jaxinfer: the manager reads and
writes a sequence through the KVSequence protocol.
"""

from jaxinfer.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from jaxinfer.kv.groups import FullAttention, KVCacheGroup, SlidingWindow, group_for
from jaxinfer.kv.host_tier import HostTier, Transfers
from jaxinfer.kv.manager import KVCacheManager
from jaxinfer.kv.page_pool import NULL_PAGE, OutOfPagesError, PagePool
from jaxinfer.kv.prefix import NO_PREFIX, ComputedPrefix, KVSequence
from jaxinfer.kv.prefix_cache import hash_page
from jaxinfer.kv.swap import SwapCost, SwappedKV

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "ComputedPrefix",
    "FullAttention",
    "HostTier",
    "KVCacheGroup",
    "KVCacheManager",
    "KVEvent",
    "KVSequence",
    "NO_PREFIX",
    "NULL_PAGE",
    "OutOfPagesError",
    "PagePool",
    "SlidingWindow",
    "SwapCost",
    "SwappedKV",
    "Transfers",
    "group_for",
    "hash_page",
]
