"""KV events over ZMQ in vLLM's wire format, for routers that route by prefix (vllm-router's
`kv_aware` policy, llm-d's precise prefix-cache scorer).

    publisher = KVEventPublisher("tcp://*:5557", replay_endpoint="tcp://*:5558")
    publisher.attach(engine)          # every replica's KV cache manager records its events
    publisher.on_step(engine)         # the engine thread, after each step: one batch per replica

Each data replica is a data-parallel rank: replica r publishes on the endpoint's port + r (as
vLLM offsets its ranks), each rank with its own sequence numbers. A batch is three frames:
`[topic, sequence number (8 bytes, big endian, from 0), msgpack payload]`; the payload is the
array `[timestamp, events, rank]` and each event a map tagged by `"type"`:

    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | None,
     "token_ids": [...], "block_size": page_size, "lora_id": None, "medium": "GPU",
     "lora_name": name | None}
    {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU"}
    {"type": "AllBlocksCleared"}

Block hashes are the engine's page hashes as integers (their last 8 bytes, big endian, as vLLM
sends by default); a router uses them only to chain pages and to drop removed ones, hashing the
token ids itself. Only the pages of the device's first layer group are published (one per page:
what a router needs to find a prefix). With `replay_endpoint`, a ROUTER socket answers
`[identity, b"", start (8 bytes)]` with the batches it still holds from `start` on, each as
`[identity, b"", topic, seq, payload]`, then `[identity, b"", b"", -1 (8 bytes), b""]`.
"""

from __future__ import annotations

import collections
import logging
import re
import threading
import time
from collections.abc import Hashable
from typing import Any

import msgpack
import zmq

from jaxinfer.kv import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

logger = logging.getLogger(__name__)

MEDIUM = "GPU"  # what vLLM names the accelerator's memory (routers credit it as the device tier)
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_ENDPOINT = re.compile(r"^tcp://(?P<host>\*|\[[^\]]+\]|[^:/\[\]]+):(?P<port>\d{1,5})$")


def offset_endpoint(endpoint: str, rank: int) -> str:
    """`tcp://HOST:PORT` for data-parallel rank `rank`: the port plus the rank (vLLM's rule)."""
    match = _ENDPOINT.match(endpoint)
    if match is None:
        raise ValueError(f"kv events endpoint {endpoint!r}: expected tcp://HOST:PORT (HOST may be *)")
    port = int(match["port"]) + rank
    if not 0 < port < 65536:
        raise ValueError(f"kv events endpoint {endpoint!r}: port {port} for rank {rank} is out of range")
    return f"tcp://{match['host']}:{port}"


def wire_hash(page_hash: Hashable) -> int:
    """A page hash (bytes, kv.hash_page's) as the integer vLLM publishes: its last 8 bytes, big endian."""
    if isinstance(page_hash, bytes):
        return int.from_bytes(page_hash[-8:], "big")
    if isinstance(page_hash, int):
        return page_hash & (2**64 - 1)
    raise TypeError(f"a page hash of type {type(page_hash).__name__} has no wire form")


def encode_event(event: KVEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": [wire_hash(h) for h in event.page_hashes],
            "parent_block_hash": None if event.parent_hash is None else wire_hash(event.parent_hash),
            "token_ids": list(event.token_ids),
            "block_size": event.page_size,
            "lora_id": None,
            "medium": MEDIUM,
            "lora_name": event.lora_name,
        }
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": [wire_hash(h) for h in event.page_hashes], "medium": MEDIUM}
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(events: list[KVEvent], rank: int, timestamp: float | None = None) -> bytes:
    """One batch's msgpack payload: [timestamp, events, rank]."""
    ts = time.time() if timestamp is None else timestamp
    return msgpack.packb([ts, [encode_event(e) for e in events], rank], use_bin_type=True)


class _Rank:
    """One data-parallel rank's PUB socket, sequence numbers, and the batches kept for replay."""

    def __init__(self, context: zmq.Context, endpoint: str, replay: str | None, topic: bytes, keep: int):
        self.topic, self.seq = topic, 0
        self.pub = context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(endpoint)
        self.kept: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=keep)
        self.kept_lock = threading.Lock()  # the engine thread appends, the replay thread reads
        self.replay = None
        if replay is not None:
            self.replay = context.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.bind(replay)

    def send(self, payload: bytes) -> None:
        seq = self.seq.to_bytes(8, "big")
        self.pub.send_multipart((self.topic, seq, payload))
        with self.kept_lock:
            self.kept.append((self.seq, payload))
        self.seq += 1

    def answer_replay(self) -> None:
        """One replay request (the replay thread, once its socket has one)."""
        assert self.replay is not None
        frames = self.replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("kv events: a malformed replay request (%d frames) ignored", len(frames))
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        with self.kept_lock:
            batches = [(seq, payload) for seq, payload in self.kept if seq >= start]
        for seq, payload in batches:
            self.replay.send_multipart((identity, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self.replay.send_multipart((identity, b"", b"", END_OF_REPLAY, b""))


class KVEventPublisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "", keep: int = 10_000):
        offset_endpoint(endpoint, 0)  # checked now, named in the error
        if replay_endpoint is not None:
            offset_endpoint(replay_endpoint, 0)
        self.endpoint, self.replay_endpoint, self.topic, self.keep = endpoint, replay_endpoint, topic, keep
        self._context = zmq.Context()
        self._ranks: list[_Rank] = []
        self._stop = threading.Event()
        self._replayer: threading.Thread | None = None
        self.num_batches = 0

    def attach(self, engine: Any) -> None:
        """Binds one PUB socket (and replay socket) per data replica, turns on each replica's
        event recording and starts the thread that answers replay requests."""
        for rank, replica in enumerate(engine.replicas):
            replay = offset_endpoint(self.replay_endpoint, rank) if self.replay_endpoint else None
            endpoint = offset_endpoint(self.endpoint, rank)
            try:
                self._ranks.append(_Rank(self._context, endpoint, replay, self.topic.encode(), self.keep))
            except zmq.ZMQError as e:
                self.close()
                raise ValueError(f"kv events endpoint {endpoint!r} (rank {rank}): {e}") from None
            replica.kv_cache.enable_events()
        if self.replay_endpoint is not None:
            self._replayer = threading.Thread(target=self._answer_replays, name="jaxinfer-kv-replay", daemon=True)
            self._replayer.start()

    def sources(self, host: str) -> dict[str, dict[str, Any]]:
        """What GET /kv_event_sources answers: each rank's endpoints (a bind-all host as `host`)."""
        out = {}
        for rank in range(len(self._ranks)):
            replay = offset_endpoint(self.replay_endpoint, rank) if self.replay_endpoint else None
            out[str(rank)] = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": _reachable(offset_endpoint(self.endpoint, rank), host),
                "replay_endpoint": _reachable(replay, host) if replay else None,
                "topic": self.topic,
                "buffer_steps": self.keep,
                "hwm": 100_000,
                "encoding": "msgpack",
                "schema_version": 1,
            }
        return out

    def on_step(self, engine: Any) -> None:
        """Publishes each replica's events since the last call (the engine thread only)."""
        for rank, (replica, out) in enumerate(zip(engine.replicas, self._ranks)):
            events = replica.kv_cache.take_events()
            if events:
                out.send(encode_batch(events, rank))
                self.num_batches += 1

    def _answer_replays(self) -> None:
        poller = zmq.Poller()
        by_socket = {}
        for out in self._ranks:
            if out.replay is not None:
                poller.register(out.replay, zmq.POLLIN)
                by_socket[out.replay] = out
        while not self._stop.is_set():
            for socket, _ in poller.poll(100):
                by_socket[socket].answer_replay()

    def close(self) -> None:
        """Stops the replay thread and closes every socket (after the engine thread has stopped)."""
        self._stop.set()
        if self._replayer is not None:
            self._replayer.join(5)
        for out in self._ranks:
            out.pub.close()
            if out.replay is not None:
                out.replay.close()
        self._ranks = []
        if not self._context.closed:
            self._context.term()


def _reachable(endpoint: str, host: str) -> str:
    """A bind-all endpoint (`*`) as one a subscriber can connect to."""
    return endpoint.replace("tcp://*:", f"tcp://{host}:", 1)
