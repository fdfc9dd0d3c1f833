"""KV events over ZMQ: what an engine publishes decodes with vLLM's event schema (declared here
with msgspec as vLLM declares it: tagged event maps, the batch an array, unknown fields refused),
one batch per step with sequence numbers from 0, stored pages chained to their parents with the
prompt's tokens, removals and clears; a replay request gets the batches back; bad endpoints are
refused by name."""

import socket

import msgspec
import pytest
import zmq
from engine_runs import run_requests
from testpaths import FIXTURES

from jaxinfer.config import EngineConfig
from jaxinfer.engine import Engine
from jaxinfer.loader import load_model
from jaxinfer.sampling import SamplingParams
from serving.kv_events import KVEventPublisher, offset_endpoint

Hash = int | bytes


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, forbid_unknown_fields=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Hash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, forbid_unknown_fields=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(KVEventBatch)
PAGE = 4


def _receive(sub: zmq.Socket) -> tuple[int, KVEventBatch]:
    assert sub.poll(5000), "no batch published"
    topic, seq, payload = sub.recv_multipart()
    assert topic == b"" and len(seq) == 8
    return int.from_bytes(seq, "big"), DECODER.decode(payload)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_published_batches_decode_with_vllms_schema_and_replay():
    port, replay_port = _free_port(), _free_port()
    model = load_model(FIXTURES / "hf" / "llama3", dtype="float32", with_tokenizer=False)
    config = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, token_buckets=(16,), page_size=PAGE)
    engine = Engine(model, EngineConfig(**config, num_pages=9, penalties=False), warm_up=False)
    publisher = KVEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}")
    publisher.attach(engine)
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        publisher.on_step(engine)  # nothing happened yet: no batch
        sub.poll(200)  # the subscription reaches the publisher
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        first = list(range(1, 14))  # 13 tokens: 3 full pages once computed
        run_requests(engine, [(first, params)], watch=publisher.on_step)
        seq, batch = _receive(sub)
        assert seq == 0 and batch.data_parallel_rank == 0
        stored = [e for e in batch.events if isinstance(e, BlockStored)]
        assert stored[0].parent_block_hash is None and stored[0].block_size == PAGE and stored[0].medium == "GPU"
        chain = [h for e in stored for h in e.block_hashes]
        tokens = [t for e in stored for t in e.token_ids]
        assert tokens[: 3 * PAGE] == first[: 3 * PAGE] and len(tokens) == len(chain) * PAGE
        for e in stored[1:]:  # each run of pages follows the page before it
            assert e.parent_block_hash == chain[chain.index(e.block_hashes[0]) - 1]
        # Other prompts fill the 8 usable pages: the first prompt's cached pages are evicted.
        run_requests(engine, [(list(range(100 + 20 * i, 113 + 20 * i)), params) for i in range(3)])
        publisher.on_step(engine)
        removed = []
        while sub.poll(500):
            _, batch = _receive(sub)
            removed += [h for e in batch.events if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert set(chain[:3]) <= set(removed)
        engine.kv_cache.reset_prefix_cache()
        publisher.on_step(engine)
        last, batch = _receive(sub)
        assert isinstance(batch.events[-1], AllBlocksCleared)
        dealer = context.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(5000), "the replay did not answer"
            empty, topic, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            replayed.append(int.from_bytes(seq, "big"))
            DECODER.decode(payload)
        assert replayed == list(range(1, last + 1))
        dealer.close()
    finally:
        sub.close()
        publisher.close()


def test_bad_endpoints_are_refused_by_name():
    with pytest.raises(ValueError, match="kv events endpoint 'udp://x:1': expected tcp://HOST:PORT"):
        KVEventPublisher("udp://x:1")
    with pytest.raises(ValueError, match="port 65536 for rank 1 is out of range"):
        offset_endpoint("tcp://*:65535", 1)
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
