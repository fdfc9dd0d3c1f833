"""KVConnector: an engine's side of disaggregated prefill/decode -- its prompts' pages offered to
other engines, and pages of prompts other engines computed pulled into its pool.

    prefill   a request with kv_transfer_params {do_remote_decode: true} runs as usual (the router
              asks max_tokens=1); when it finishes, its pages are kept (core/queue.py), gathered
              (kv_transfer.py: a copy held for the pull) and given back to the pool (they stay
              in the prefix cache); its final output carries the params a decode engine needs
              (core/kv_transfer_params.py). The copy is dropped once pulled, or after
              `kv_transfer_ttl` seconds, or sooner where the copies held would pass
              `max_held_pages` (half the pool's pages: the oldest unclaimed first).
    decode    a request with the prefill's params {do_remote_prefill: true}: its first sample waits
              (Sequence.pulling) while a thread claims the offer over the prefill's side channel
              and pulls it; between two steps the engine thread takes the pages from the KV
              manager (`receive`) and writes them, and the sequence starts from them (its prompt's
              last token recomputed for its logits, as after a prefix hit).

The side channel is a ZMQ ROUTER on `kv_transfer_host` (msgpack {"op": "claim" | "done", "id"}):
a claim checks that the offer is still held before the pull (a pull of an offer that is gone would
wait forever), "done" releases it. Whatever fails on the decode side -- the prefill server gone or
not answering in `kv_transfer_timeout` seconds, the offer expired, another prompt or page layout --
ends in the decode engine computing the prompt itself (logged, counted), never in a hang.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import random
import threading
import time
from typing import Any

import jax
import msgpack
import zmq

from jaxinfer.config.kv_transfer import KVTransferConfig
from jaxinfer.core.kv_transfer_params import KVTransferRequest, prompt_hash
from jaxinfer.kv import NULL_PAGE
from jaxinfer.worker.kv_transfer import KVTransfer, split_widths

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Offer:
    ids: list[int]
    calls: list[list[jax.Array]]  # the gathered copies, alive until pulled
    num_pages: int
    expires: float
    claimed: bool = False


@dataclasses.dataclass
class Pulled:
    """A pull that ended: its arrays landed (`fetched`), or why it failed."""

    request_id: str
    ticket: dict[str, Any]
    fetched: list[list[jax.Array]] | None
    why: str | None = None


class KVConnector:
    def __init__(self, state: Any, config: KVTransferConfig, max_held_pages: int):
        self.config, self.host, self.max_held_pages = config, config.kv_transfer_host, max_held_pages
        self.transfer = KVTransfer(state, self.host)
        self.engine_id = f"jaxinfer-{random.getrandbits(48):012x}"
        self._lock = threading.Lock()
        self._offers: dict[int, _Offer] = {}  # by their first transfer id
        self._context = zmq.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self.port = self._router.bind_to_random_port(f"tcp://{self.host}")
        self._landed: queue.SimpleQueue[Pulled] = queue.SimpleQueue()
        self._waiting: list[Pulled] = []  # landed, but the pool had no room yet
        self.num_pulling = 0
        self.counts = dict.fromkeys(("offered", "pages_offered", "pulled_by_peers", "expired"), 0)
        self.counts.update(dict.fromkeys(("pulls", "pages_pulled"), 0))  # recomputes: Disaggregation counts them
        self._closed = threading.Event()
        threading.Thread(target=self._serve, name="jaxinfer-kv-side-channel", daemon=True).start()

    # --- prefill side (engine thread) -------------------------------------------------------------
    def offer(self, tables: list[list[int]], token_ids: list[int], lora_name: str | None) -> dict[str, Any]:
        """Gathers a finished prefill's pages and holds them for one pull: its kv_transfer_params."""
        pages = [p for table in tables for p in table if p != NULL_PAGE]
        widths = split_widths(len(pages))
        base = random.getrandbits(52) << 8
        ids = [base + i for i in range(len(widths))]
        calls = self.transfer.offer(ids, pages)
        with self._lock:
            self._offers[ids[0]] = _Offer(ids, calls, len(pages), time.monotonic() + self.config.kv_transfer_ttl)
            self.counts["offered"] += 1
            self.counts["pages_offered"] += len(pages)
            held = sum(o.num_pages for o in self._offers.values())
            for older in list(self._offers.values())[:-1]:  # past the cap: the oldest unclaimed given up
                if held <= self.max_held_pages:
                    break
                if not older.claimed:
                    older.expires, held = 0.0, held - older.num_pages  # the side channel lets it go
        return {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_block_ids": pages,
            "transfer_address": self.transfer.address,
            "transfer_ids": ids,
            "widths": widths,
            "tables": ["".join("0" if p == NULL_PAGE else "1" for p in table) for table in tables],
            "num_tokens": len(token_ids),
            "prompt_hash": prompt_hash(token_ids, lora_name),
            "lora_name": lora_name,
            "layout": self.transfer.layout(),
        }

    @property
    def num_held(self) -> int:
        """Offers held for a pull now."""
        return len(self._offers)

    # --- the side channel (its own thread) --------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        while not self._closed.is_set():
            if poller.poll(200):
                try:
                    identity, _, payload = self._router.recv_multipart()
                    reply = self._answer(msgpack.unpackb(payload))
                except Exception as e:  # a malformed message costs its sender only
                    logger.warning("KV side channel: bad message (%s)", e)
                    continue
                self._router.send_multipart([identity, b"", msgpack.packb(reply)])
            self._expire(time.monotonic())
        self._router.close()

    def _answer(self, message: dict) -> dict:
        op, uuid = message.get("op"), message.get("id")
        with self._lock:
            offer = self._offers.get(uuid) if isinstance(uuid, int) else None
            if offer is None:
                return {"ok": False, "why": f"no offer {uuid}: it expired or was pulled"}
            if op == "claim" and not offer.claimed:
                offer.claimed, offer.expires = True, time.monotonic() + self.config.kv_transfer_ttl
                return {"ok": True}
            if op == "done":
                del self._offers[offer.ids[0]]
                self.counts["pulled_by_peers"] += 1
                return {"ok": True}
        return {"ok": False, "why": f"offer {uuid}: {op!r} is not a claim of an unclaimed offer nor done"}

    def _expire(self, now: float) -> None:
        with self._lock:
            gone = [uuid for uuid, offer in self._offers.items() if offer.expires < now]
            expired = [self._offers.pop(uuid) for uuid in gone]
            self.counts["expired"] += len(expired)
        for offer in expired:  # the transfer server still holds an unpulled copy: pulled here to free it
            if not offer.claimed:
                widths = [call[0].shape[0] for call in offer.calls]
                fetched = self.transfer.fetch(self.transfer.address, offer.ids, widths)
                threading.Thread(target=jax.block_until_ready, args=(fetched,), daemon=True).start()
            logger.warning("KV offer %d of %d pages expired unpulled", offer.ids[0], offer.num_pages)

    # --- decode side ------------------------------------------------------------------------------
    def start_pull(self, request_id: str, ticket: dict[str, Any]) -> None:
        """Claims and pulls an offer on a thread of its own; it lands in `take_landed`."""
        self.num_pulling += 1
        threading.Thread(target=self._pull, args=(request_id, ticket), name="jaxinfer-kv-pull", daemon=True).start()

    def _pull(self, request_id: str, ticket: dict[str, Any]) -> None:
        deadline = time.monotonic() + self.config.kv_transfer_timeout
        try:
            endpoint = f"tcp://{ticket['remote_host']}:{ticket['remote_port']}"
            answer = self._ask(endpoint, {"op": "claim", "id": ticket["transfer_ids"][0]}, deadline)
            if not answer.get("ok"):
                raise RuntimeError(answer.get("why", "the offer was refused"))
            fetched = self.transfer.fetch(ticket["transfer_address"], ticket["transfer_ids"], ticket["widths"])
            waiter = threading.Thread(target=jax.block_until_ready, args=(fetched,), daemon=True)
            waiter.start()
            waiter.join(max(0.0, deadline - time.monotonic()))
            if waiter.is_alive():
                self.transfer.forget(ticket["transfer_address"])
                raise TimeoutError(f"the pages did not arrive in {self.config.kv_transfer_timeout}s")
            jax.block_until_ready(fetched)  # raises what the pull raised (a peer that died mid-way)
            try:
                self._ask(endpoint, {"op": "done", "id": ticket["transfer_ids"][0]}, time.monotonic() + 1.0)
            except Exception as e:  # pulled all the same; the prefill engine's TTL frees its copy
                logger.info("KV pull of request %s: 'done' not delivered (%s)", request_id, e)
            self._landed.put(Pulled(request_id, ticket, fetched))
        except Exception as e:
            self.transfer.forget(ticket.get("transfer_address", ""))
            self._landed.put(Pulled(request_id, ticket, None, f"{type(e).__name__}: {e}"))

    def _ask(self, endpoint: str, message: dict, deadline: float) -> dict:
        socket = self._context.socket(zmq.REQ)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.connect(endpoint)
            socket.send(msgpack.packb(message))
            if not socket.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                raise TimeoutError(f"{endpoint} did not answer in time (the prefill server is gone?)")
            return msgpack.unpackb(socket.recv())
        finally:
            socket.close()

    def take_landed(self) -> list[Pulled]:
        """Pulls that ended since the last call, after those still waiting for room, oldest first."""
        landed, self._waiting = self._waiting, []
        while True:
            try:
                item = self._landed.get_nowait()
            except queue.Empty:
                return landed
            self.num_pulling -= 1
            landed.append(item)

    def wait_for_room(self, pulled: Pulled) -> None:
        """A landed pull the pool has no room for yet: handed back by the next take_landed."""
        self._waiting.append(pulled)

    @property
    def busy(self) -> bool:
        """Pulls in flight or landed and waiting."""
        return bool(self.num_pulling or self._waiting)

    def check(self, kv: KVTransferRequest, token_ids: list[int], lora: str | None) -> str | None:
        """Why an offer cannot serve this request here (None: pull it)."""
        ticket = kv.ticket or {}
        if ticket["prompt_hash"] != prompt_hash(token_ids, lora):
            return "the prefill server computed another prompt (or under another adapter or tokenizer)"
        if ticket["layout"] != self.transfer.layout():
            return f"its pages {ticket['layout']} are not this pool's {self.transfer.layout()}"
        if ticket["num_tokens"] > len(token_ids):
            return f"{ticket['num_tokens']} tokens offered for a prompt of {len(token_ids)}"
        return None

    def close(self) -> None:
        self._closed.set()
