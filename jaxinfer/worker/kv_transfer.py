"""KV pages moved between two engines' pools over the network with `jax.experimental.transfer`
(a pull: the receiving engine fetches, as vLLM's TPU backend and sglang-jax move KV from a
prefill engine to a decode engine). The first piece of disaggregated prefill/decode.

    source = KVTransfer(state)                   a transfer server of this process
    ticket = source.offer(transfer_id, pages)    the pages of every cache gathered and held
                                                 for one pull (a JSON-able dict to send)
    sink = KVTransfer(other_state)
    sink.pull(ticket, pages)                     fetched and written into `pages` of its pool

A transfer moves `width` pages, the smallest power of two that holds them (padding: the null
page), so the gather and the scatter compile once per width (`warm_up` compiles them all). The
caches move as stored (int8 / fp8 pages with them; their per-head scales are the engine's own).
Both pools must hold pages of the same shape and dtype (checked, named in the error); one data
replica, on one device or a mesh whose page shards are the same on both sides.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax
import numpy as np
from jax.experimental import transfer

from jaxinfer.kv import NULL_PAGE
from jaxinfer.quant.kv_cache import kv_pages
from jaxinfer.worker.kv_host import gather_pages, scatter_pages
from sharding.multihost import put_inputs


class KVTransfer:
    def __init__(self, state: Any, address: str = "127.0.0.1:0"):
        if state.num_replicas > 1:
            raise ValueError("KV transfers move one data replica's pages; this engine has several")
        self.state = state
        self.server = transfer.start_transfer_server(state.local_device.client, address, [address])
        self.widths = tuple(itertools.takewhile(lambda w: w <= 2 * state.pages_per_seq, (2**i for i in range(32))))
        formats = jax.tree.map(lambda c: c.format, state.kv_caches)
        values = [kv_pages(c).sharding for c in state.kv_caches]  # pulled arrays come as the specs say
        self._gather = jax.jit(gather_pages)
        self._scatter = jax.jit(
            scatter_pages, donate_argnums=0, in_shardings=(formats, state.home, values), out_shardings=formats
        )
        self._held: dict[int, list[jax.Array]] = {}  # offered, until pulled (the arrays must live)

    @property
    def address(self) -> str:
        return self.server.address()

    def layout(self) -> list[dict[str, Any]]:
        """Each cache's page: shape and dtype (what the other side must hold)."""
        return [{"page": list(kv_pages(c).shape[-3:]), "dtype": str(kv_pages(c).dtype)} for c in self.state.kv_caches]

    def width_for(self, num_pages: int) -> int:
        for width in self.widths:
            if width >= num_pages:
                return width
        raise ValueError(f"{num_pages} pages in one transfer: at most {self.widths[-1]}")

    def warm_up(self) -> None:
        """Compiles the gather and the scatter of every width."""
        with self.state.mesh_context():
            for width in self.widths:
                ids = self._ids([NULL_PAGE] * width)
                gathered = list(self._gather(self.state.kv_caches, ids))
                self.state.kv_caches = self._scatter(self.state.kv_caches, ids, gathered)

    def offer(self, transfer_id: int, pages: list[int]) -> dict[str, Any]:
        """Gathers `pages` of every cache and holds them for one pull under `transfer_id`; the
        ticket the pulling side needs."""
        width = self.width_for(len(pages))
        with self.state.mesh_context():
            gathered = list(self._gather(self.state.kv_caches, self._ids(pages + [NULL_PAGE] * (width - len(pages)))))
        self.server.await_pull(transfer_id, gathered)
        self._held[transfer_id] = gathered
        return {
            "address": self.address,
            "transfer_id": transfer_id,
            "num_pages": len(pages),
            "width": width,
            "layout": self.layout(),
        }

    def release(self, transfer_id: int) -> None:
        """Forgets an offer (pulled, or given up on)."""
        self._held.pop(transfer_id, None)

    def pull(self, ticket: dict[str, Any], pages: list[int], timeout: Any = None) -> None:
        """Fetches an offer and writes its pages into `pages` of this pool (as many as it holds)."""
        if ticket["layout"] != self.layout():
            raise ValueError(f"KV transfer: the source's pages {ticket['layout']} are not this pool's {self.layout()}")
        if len(pages) != ticket["num_pages"]:
            raise ValueError(f"KV transfer of {ticket['num_pages']} pages into {len(pages)} pages")
        width = int(ticket["width"])
        specs = [
            jax.ShapeDtypeStruct((width, *kv_pages(c).shape[-3:]), kv_pages(c).dtype, sharding=kv_pages(c).sharding)
            for c in self.state.kv_caches
        ]
        connection = self.server.connect(ticket["address"])
        values = connection.pull(int(ticket["transfer_id"]), specs, timeout=timeout)
        with self.state.mesh_context():
            ids = self._ids(pages + [NULL_PAGE] * (width - len(pages)))
            self.state.kv_caches = self._scatter(self.state.kv_caches, ids, list(values))

    def _ids(self, pages: list[int]) -> jax.Array:
        return put_inputs(np.asarray(pages, np.int32), self.state.home)
