"""KV pages moved between two engines' pools over the network with `jax.experimental.transfer`
(a pull: the receiving engine fetches, as vLLM's TPU backend and sglang-jax move KV from a
prefill engine to a decode engine). kv_connector.py drives it for disaggregated prefill/decode.

    source = KVTransfer(state)                   a transfer server of this process
    calls = source.offer(ids, pages)             the pages of every cache gathered and held for
                                                 one pull per call (ids: one per call)
    sink = KVTransfer(other_state)
    got = sink.fetch(address, ids, widths)       the calls' arrays, arriving (any thread)
    sink.write(got, pages)                       written into `pages` of its pool (engine thread)

Each call moves `width` pages (1, 4, 16 or 64, the smallest that holds them; a longer list takes
several calls of 64), padding with the null page, so the gather and the scatter compile once per
width (`warm_up` compiles them all). The pages travel as one copy on one device of each side:
the source gathers them replicated over its mesh (a tensor-sharded cache: its heads gathered) and
offers its local device's copy; the sink scatters them into its own layout, so the two sides may
shard their caches differently (resharded on arrival). Caches move as stored (int8 / fp8 pages
with them; their per-head scales are each engine's own, calibrated alike). Both pools must hold
pages of one shape and dtype (`layout`, checked by the connector); one data replica, one host.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import transfer
from jax.sharding import SingleDeviceSharding

from jaxinfer.kv import NULL_PAGE
from jaxinfer.quant.kv_cache import kv_pages
from jaxinfer.worker.kv_host import gather_pages, scatter_pages
from sharding import is_multiprocess

WIDTHS = (1, 4, 16, 64)


def split_widths(num_pages: int) -> list[int]:
    """The calls' widths that move `num_pages` pages: 64s, then the smallest width for the rest."""
    widths = [WIDTHS[-1]] * (num_pages // WIDTHS[-1])
    rest = num_pages - sum(widths)
    if rest:
        widths.append(next(w for w in WIDTHS if w >= rest))
    return widths


class KVTransfer:
    def __init__(self, state: Any, host: str = "127.0.0.1"):
        if state.num_replicas > 1 or is_multiprocess():
            raise ValueError("KV transfers between engines need one data replica on one host")
        self.state = state
        self.server = transfer.start_transfer_server(state.local_device.client, f"{host}:0", [f"{host}:0"])
        self.device = SingleDeviceSharding(state.local_device)
        formats = jax.tree.map(lambda c: c.format, state.kv_caches)
        self._gather = jax.jit(gather_pages, out_shardings=state.home)
        home = [state.home] * len(state.kv_caches)
        self._scatter = jax.jit(
            scatter_pages, donate_argnums=0, in_shardings=(formats, state.home, home), out_shardings=formats
        )
        self._connections: dict[str, Any] = {}

    @property
    def address(self) -> str:
        return self.server.address()

    def layout(self) -> list[dict[str, Any]]:
        """Each cache's page: shape and dtype (what the other side must hold)."""
        return [{"page": list(kv_pages(c).shape[-3:]), "dtype": str(kv_pages(c).dtype)} for c in self.state.kv_caches]

    def warm_up(self) -> None:
        """Compiles the gather and the scatter of every width."""
        with self.state.mesh_context():
            for width in WIDTHS:
                ids = self._ids([NULL_PAGE] * width)
                gathered = list(self._gather(self.state.kv_caches, ids))
                self.state.kv_caches = self._scatter(self.state.kv_caches, ids, gathered)

    def offer(self, ids: list[int], pages: list[int]) -> list[list[jax.Array]]:
        """Gathers `pages` of every cache (in calls of split_widths) and holds each call's copy for
        one pull under its id; returns the copies (they must live until pulled)."""
        widths = split_widths(len(pages))
        if len(ids) != len(widths):
            raise ValueError(f"{len(ids)} transfer ids for {len(widths)} calls")
        offered, start = [], 0
        for uuid, width in zip(ids, widths):
            chunk = pages[start : start + width]
            start += width
            with self.state.mesh_context():
                gathered = self._gather(self.state.kv_caches, self._ids(chunk + [NULL_PAGE] * (width - len(chunk))))
            local = [a if len(a.devices()) == 1 else a.addressable_shards[0].data for a in gathered]
            self.server.await_pull(uuid, local)
            offered.append(local)
        return offered

    def fetch(self, address: str, ids: list[int], widths: list[int]) -> list[list[jax.Array]]:
        """Starts pulling each call of an offer; the arrays arrive later (block on them)."""
        specs = [
            [
                jax.ShapeDtypeStruct((w, *kv_pages(c).shape[-3:]), kv_pages(c).dtype, sharding=self.device)
                for c in self.state.kv_caches
            ]
            for w in widths
        ]
        connection = self._connections.get(address)
        if connection is None:
            connection = self._connections[address] = self.server.connect(address)
        return [connection.pull(uuid, spec) for uuid, spec in zip(ids, specs)]

    def forget(self, address: str) -> None:
        """Drops the connection to a source that failed (the next pull connects again)."""
        self._connections.pop(address, None)

    def write(self, fetched: list[list[jax.Array]], pages: list[int]) -> None:
        """Writes fetched calls into `pages` of this pool (as many as the offer held)."""
        start = 0
        for values in fetched:
            width = values[0].shape[0]
            chunk = pages[start : start + width]
            start += width
            if self.state.mesh is not None:
                values = jax.device_put(values, self.state.home)
            with self.state.mesh_context():
                ids = self._ids(chunk + [NULL_PAGE] * (width - len(chunk)))
                self.state.kv_caches = self._scatter(self.state.kv_caches, ids, list(values))

    def _ids(self, pages: list[int]) -> jax.Array:
        return jax.device_put(np.asarray(pages, np.int32), self.state.home)
