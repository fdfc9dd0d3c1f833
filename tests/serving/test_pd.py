"""Disaggregated prefill/decode between two `jaxinfer serve` processes (the random llama3 fixture
with a chat template: a prefill server and a decode server) behind vllm-router's P/D mode (the
PyPI release, on loopback): chat and completions, streamed and not, n > 1, answer as the decode
server alone does, from pages it pulled (its metrics count them, none recomputed); the gRPC API
carries the same params; malformed params are refused by name; the prefill server killed between
the phases costs a recompute, not the answer; the pages on both sides are all free at the end."""

import concurrent.futures
import json
import urllib.request

import pytest
from openai_support import ServedProcess, metric, raw_request, wait_for
from router_support import Router, install_router, post
from testpaths import FIXTURES, TINY_SERVE_ARGS

from serving.grpc.client import Client

MODEL = "llama3"
# The tiny servers of test_router.py (their step variants are in the run's compilation cache), with
# a tokenizer and a chat template (tools/make_chat_fixture.py).
TINY = [str(FIXTURES / "hf" / "llama3_chat") if arg.endswith("llama3") else arg for arg in TINY_SERVE_ARGS]
ARGS = [*TINY, "--port", "0", "--http-port", "0", "--served-model-name", MODEL, "--kv-transfer-timeout", "1.5"]
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
CASES = [
    ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 12, "temperature": 0, "ignore_eos": True}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0.8, "seed": 3, "n": 2}),
]
pytestmark = pytest.mark.xdist_group("router")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A prefill server and a decode server (both load and compile at once)."""
    logs = tmp_path_factory.mktemp("pd")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(ServedProcess, [*ARGS, "--kv-role", role], logs / f"{role}.log")
            for role in ("prefill", "decode")
        ]
        prefill, decode = (f.result() for f in futures)
    yield prefill, decode
    prefill.stop()
    decode.stop()


@pytest.fixture(scope="module")
def router(pair, tmp_path_factory):
    prefill, decode = pair
    args = ["--vllm-pd-disaggregation", "--prefill", prefill.http, "--decode", decode.http, "--policy", "round_robin"]
    router = Router(install_router(), args, tmp_path_factory.mktemp("router") / "router.log")
    yield router
    router.stop()


def _texts(answer: dict) -> list[str]:
    return [c["text"] if "text" in c else c["message"]["content"] for c in answer["choices"]]


def _streamed(url: str, path: str, body: dict) -> list[str]:
    """The texts of a streamed answer, each choice's deltas joined."""
    data = json.dumps({**body, "model": MODEL, "stream": True}).encode()
    request = urllib.request.Request(f"{url}{path}", data, {"Content-Type": "application/json"})
    texts: dict[int, str] = {}
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                piece = c.get("text") if "text" in c else c.get("delta", {}).get("content")
                texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
    return [texts[i] for i in sorted(texts)]


def test_pd_answers_as_the_decode_server_alone(router, pair):
    prefill, decode = pair
    pulls = metric(decode, "jaxinfer_kv_transfer_pulls_total")
    for path, body in CASES:
        body = {**body, "model": MODEL}
        alone = _texts(post(decode.http, path, body))  # no kv_transfer_params: it computes the prompt
        assert _texts(router.post(path, body)) == alone, (path, body)
        assert _streamed(router.url, path, body) == alone, (path, body)
    assert metric(decode, "jaxinfer_kv_transfer_pulls_total") - pulls == 2 * len(CASES)
    assert metric(decode, "jaxinfer_kv_transfer_pages_pulled_total") > 0
    assert metric(decode, "jaxinfer_kv_transfer_recomputed_total") == 0
    assert metric(prefill, "jaxinfer_kv_transfer_offers_total") == 2 * len(CASES)
    wait_for(lambda: metric(prefill, "jaxinfer_kv_transfer_offers_held") == 0)  # each released once pulled
    for server in pair:  # no page held by anyone
        wait_for(lambda server=server: metric(server, "jaxinfer_kv_cache_usage_ratio") == 0)


def test_the_grpc_api_carries_the_same_params(pair):
    prefill, decode = pair
    with Client(prefill.grpc) as p, Client(decode.grpc) as d:
        first = p.generate("The capital of France is", max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        ticket = first.kv_transfer_params
        assert ticket["do_remote_prefill"] and ticket["num_tokens"] == first.usage.prompt_tokens
        pulled = d.generate("The capital of France is", max_tokens=12, temperature=0, kv_transfer_params=ticket)
        assert pulled.text == d.generate("The capital of France is", max_tokens=12, temperature=0).text


@pytest.mark.parametrize(
    ("params", "why"),
    [
        ({"do_remote_prefill": True, "remote_host": "127.0.0.1"}, "kv_transfer_params.remote_port=None"),
        ({"do_remote_decode": True}, "kv_transfer_params.do_remote_decode=true: this server's kv_role is decode"),
        ("yes", 'kv_transfer_params="yes": Input should be a valid dictionary'),
    ],
)
def test_malformed_params_are_refused_by_name(pair, params, why):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "kv_transfer_params": params}
    status, _, answer = raw_request(pair[1], "POST", "/v1/completions", body)
    assert status == 400 and why in json.loads(answer)["error"]["message"], answer


def test_the_prefill_server_gone_between_the_phases_costs_a_recompute(pair):
    prefill, decode = pair
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    ticket = post(
        prefill.http, "/v1/completions", {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    )
    prefill.stop()  # SIGKILL: its offer, transfer server and side channel gone
    recomputed = metric(decode, "jaxinfer_kv_transfer_recomputed_total")
    answer = post(decode.http, "/v1/completions", {**body, "kv_transfer_params": ticket["kv_transfer_params"]})
    assert _texts(answer) == _texts(post(decode.http, "/v1/completions", body))
    assert metric(decode, "jaxinfer_kv_transfer_recomputed_total") == recomputed + 1
    wait_for(lambda: metric(decode, "jaxinfer_kv_cache_usage_ratio") == 0)
