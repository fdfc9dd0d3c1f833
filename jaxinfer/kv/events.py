"""KV events: what entered and left the prefix cache, for consumers outside the engine.

A router that sends requests to the replica holding their prefix needs to know which page hashes
each replica holds. The PagePool records an event whenever that set changes, and the engine
drains them (`KVCacheManager.take_events`) in order:

    cache_pages()          -> BlockStored    pages full of computed tokens entered the cache
    a cached page reused   -> BlockRemoved   its content is gone (evicted to make room)
    reset_prefix_cache()   -> AllBlocksCleared

The shapes follow the KV event stream of vLLM, which routers such as vllm-router and llm-d
read: a run of consecutive pages is one BlockStored with the hash of the page before it
(`parent_hash`, None at the start of a sequence) and the token ids of all its pages in order.
Recording is off unless the manager is built with `enable_events=True` (nobody drains them
otherwise, and the list would only grow).
"""

from __future__ import annotations

import dataclasses

from jaxinfer.kv.prefix_cache import PageHash


@dataclasses.dataclass(frozen=True)
class BlockStored:
    page_hashes: tuple[PageHash, ...]  # consecutive pages of one sequence, in order
    parent_hash: PageHash | None  # the page before the first (None: the sequence's start)
    token_ids: tuple[int, ...]  # page_size tokens per page, pages in order
    page_size: int
    lora_name: str | None = None  # the LoRA adapter the pages were computed under (None: the base model)


@dataclasses.dataclass(frozen=True)
class BlockRemoved:
    page_hashes: tuple[PageHash, ...]


@dataclasses.dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
