"""Disaggregation: where the engine meets disaggregated prefill/decode (kv_connector.py moves the
pages; this decides what each request does with them).

    engine.add_request   on_request(...)     a prefill keeps its first sample's pages when it
                                             finishes; a decode's first sample waits for a pull
    engine.step          before_step(...)    landed pulls written into fresh pages of the pool
                                             (the sequence may start); failed ones recompute
    final output         on_finished(state)  a prefill's pages gathered and offered: its
                                             kv_transfer_params; the pages go back to the pool

The connector (a transfer server, a side channel) starts with the engine where `kv_role` is given,
its gathers and scatters compiled at warm-up; else on the first request that asks for a transfer.
One data replica on one host (refused at start-up otherwise).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from jaxinfer.config.kv_transfer import KVTransferConfig
from jaxinfer.core.requests import CheckedRequest
from jaxinfer.kv import NULL_PAGE

if TYPE_CHECKING:  # imported with the first transfer (ZMQ, the transfer server): not by every engine
    from jaxinfer.worker.kv_connector import KVConnector

logger = logging.getLogger(__name__)


class Disaggregation:
    def __init__(self, state: Any, config: KVTransferConfig, scheduler: Any):
        self.state, self.config, self.scheduler = state, config, scheduler
        self.kv_cache = scheduler.kv_cache
        self.connector: KVConnector | None = None
        self.recomputed = 0  # decode requests whose pages did not come: computed here
        if config.kv_role is not None:
            self._connector()

    def _connector(self) -> KVConnector:
        if self.connector is None:
            from jaxinfer.worker.kv_connector import KVConnector

            held = self.kv_cache.num_usable_pages // 2  # copies held for pulls: at most half the pool's bytes
            self.connector = KVConnector(self.state, self.config, held)
            if self.config.kv_role is None:  # started by a request: compiled now, not between steps later
                self.connector.transfer.warm_up()
        return self.connector

    def warm_up(self) -> float:
        """Compiles the transfers' gathers and scatters (where the role was given); seconds taken."""
        if self.connector is None:
            return 0.0
        start = time.perf_counter()
        self.connector.transfer.warm_up()
        return time.perf_counter() - start

    def on_request(self, request_id: str, checked: CheckedRequest, seqs: list[Any], lora: str | None) -> None:
        kv = checked.kv_transfer
        if kv is None:
            return
        if kv.kind == "produce":
            seqs[0].keep_kv = True
            return
        connector = self._connector()
        why = connector.check(kv, checked.prompt_token_ids, lora)
        if why is not None:
            self._recompute(request_id, why)
            return
        seqs[0].pulling = True
        connector.start_pull(request_id, kv.ticket or {})

    def before_step(self, requests: dict[str, Any]) -> None:
        """Writes the pulls that landed into the pool; their sequences may start this step."""
        connector = self.connector
        if connector is None or not connector.busy:
            return
        for pulled in connector.take_landed():
            state = requests.get(pulled.request_id)
            if state is None:  # aborted meanwhile
                continue
            seq = state.samples[0].seq
            if pulled.fetched is None:
                seq.pulling = False
                self._recompute(pulled.request_id, pulled.why)
                continue
            received = self.kv_cache.receive(seq, pulled.ticket["tables"], pulled.ticket["num_tokens"])
            if received is None:  # no room now: it waits, pulled, for pages to free up
                connector.wait_for_room(pulled)
                continue
            pages = [p for table in received.tables for p in table if p != NULL_PAGE]
            connector.transfer.write(pulled.fetched, pages)
            seq.pulling = False
            connector.counts["pulls"] += 1
            connector.counts["pages_pulled"] += len(pages)
        if connector.busy and not self.scheduler.running:
            time.sleep(0.001)  # only pulls in flight: the engine loop need not spin at full speed

    def on_finished(self, state: Any) -> dict[str, Any] | None:
        """A finished prefill's kv_transfer_params (None for any other request)."""
        seq = state.samples[0].seq
        if seq.kept is None:
            return None
        tables, seq.kept = seq.kept, None
        try:
            return self._connector().offer(tables, seq.prompt_token_ids, seq.adapter)
        except Exception:  # the decode server then gets no params and computes the prompt itself
            logger.exception("could not offer the KV pages of request %s", state.request_id)
            return None
        finally:
            self.kv_cache.free_tables(tables)  # gathered: the copy is what the pull reads

    def _recompute(self, request_id: str, why: str | None) -> None:
        self.recomputed += 1
        logger.warning("request %s: prompt computed here, its KV pages did not come (%s)", request_id, why)

    def stats(self) -> dict[str, int]:
        counts = self.connector.counts if self.connector is not None else {}
        return {
            "kv_transfer_pulls": counts.get("pulls", 0),
            "kv_transfer_pages_pulled": counts.get("pages_pulled", 0),
            "kv_transfer_recomputed": self.recomputed,
            "kv_transfer_offers": counts.get("offered", 0),
            "kv_transfer_pages_offered": counts.get("pages_offered", 0),
            "kv_transfer_offers_expired": counts.get("expired", 0),
            "kv_transfer_offers_held": self.connector.num_held if self.connector is not None else 0,
        }

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()
