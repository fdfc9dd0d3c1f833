"""Copying KV pages on the device: the copy-on-write half of a fork (beam search).

    copier = PageCopier(state)          # compiled once, at start-up
    copier.copy([[(src, dst), ...]])    # one list per data replica; before the step that writes

The KV cache manager shares a forked sequence's pages and, when the fork first writes into a
shared, partly filled page, gives it a fresh page and asks for the old one's contents in it
(KVCacheManager.take_page_copies, carried by the plan). Every layer's cache (an int8 / fp8
cache's pages; its per-head scales are not per page) gets `pages[dst] = pages[src]` in one jitted
call that donates the caches, for a fixed number of pairs (the rest padded with the null page
copied onto itself), so it compiles once; more pairs take more calls. The compiled step submits
the copies on its launcher, in order with the steps.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.kv import NULL_PAGE
from jaxinfer.quant.kv_cache import kv_pages, with_kv_pages


class PageCopier:
    def __init__(self, state: Any, max_pairs: int) -> None:
        self.state, self.max_pairs = state, max_pairs
        self.replicas = state.num_replicas
        fn = _copy_pages if self.replicas == 1 else jax.vmap(_copy_pages, in_axes=(0, 0, 0), spmd_axis_name="data")
        formats = jax.tree.map(lambda c: c.format, state.kv_caches)  # placement and pinned layout kept
        self._copy = jax.jit(fn, donate_argnums=0, out_shardings=formats)
        self._run(np.full((self.replicas, max_pairs, 2), NULL_PAGE, np.int32))  # compiled now, never after

    def num_compiled(self) -> int:
        return self._copy._cache_size()  # type: ignore[attr-defined]  # jit's count; not in jax's stubs

    def copy(self, pairs: list[list[tuple[int, int]]]) -> None:
        """pages[dst] = pages[src] for each replica's (src, dst) pairs, in every layer."""
        todo = max((len(p) for p in pairs), default=0)
        for start in range(0, todo, self.max_pairs):
            batch = np.full((self.replicas, self.max_pairs, 2), NULL_PAGE, np.int32)
            for r, replica_pairs in enumerate(pairs):
                chunk = replica_pairs[start : start + self.max_pairs]
                if chunk:
                    batch[r, : len(chunk)] = chunk
            self._run(batch)

    def _run(self, batch: np.ndarray) -> None:
        src, dst = (batch[..., 0], batch[..., 1]) if self.replicas > 1 else (batch[0, :, 0], batch[0, :, 1])
        with self.state.mesh_context():
            self.state.kv_caches = self._copy(self.state.kv_caches, jnp.asarray(src), jnp.asarray(dst))


def _copy_pages(caches: tuple[Any, ...], src: jax.Array, dst: jax.Array) -> tuple[Any, ...]:
    return tuple(with_kv_pages(c, kv_pages(c).at[dst].set(kv_pages(c)[src])) for c in caches)
