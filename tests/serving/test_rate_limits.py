"""Per-key rate limits over real sockets (BackgroundServer with gRPC and HTTP on the tiny fixture's
engine): 429 with Retry-After through the official `openai` client, another key unaffected, tokens
per minute refunded when a request stops early, the concurrency cap, and one limiter for both
transports (the gRPC token is the HTTP key); the request log of both transports."""

import json

import grpc
import openai
import pytest
from serving_support import client_of, slow_steps, wait_for

from serving.limits import RateLimits
from serving.openai.auth import key_id

STOP_AT_ONCE = {"stop_token_ids": list(range(512))}  # every token stops: one token generated


def openai_client(server, key):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key=key, max_retries=0, timeout=60)


def complete(client, **kwargs):
    return client.completions.create(model="llama3", prompt=kwargs.pop("prompt", [1, 2, 3, 4, 5]), **kwargs)


def rate_limit_error(fn, *args, **kwargs) -> openai.RateLimitError:
    with pytest.raises(openai.RateLimitError) as info:
        fn(*args, **kwargs)
    assert info.value.status_code == 429 and info.value.body["code"] == "rate_limit_exceeded"
    return info.value


def metric(server, name: str) -> float:
    text = server.server.metrics.exposition()[0].decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_requests_per_minute_per_key_through_the_openai_client(serve):
    server = serve(http_port=0, api_keys=("sk-a", "sk-b"), rate_limits=RateLimits(requests_per_minute=2))
    a, b = openai_client(server, "sk-a"), openai_client(server, "sk-b")
    for _ in range(2):
        assert complete(a, max_tokens=2).usage.completion_tokens == 2
    e = rate_limit_error(complete, a, max_tokens=2)
    assert "2 requests per minute" in e.body["message"] and key_id("sk-a") in e.body["message"]
    assert 20 <= int(e.response.headers["retry-after"]) <= 30  # 2 per minute: one back every 30 s
    assert complete(b, max_tokens=2).usage.completion_tokens == 2  # another key has its own budget
    assert metric(server, 'jaxinfer_rate_limited_total{limit="rpm"}') == 1


def test_tokens_per_minute_charge_max_tokens_and_refund_what_was_not_generated(serve):
    server = serve(http_port=0, api_keys=("sk-a",), rate_limits=RateLimits(tokens_per_minute=120))  # 2 per s
    client, key = openai_client(server, "sk-a"), key_id("sk-a")
    left = lambda: server.server.limiter.available(key)["tpm"]  # noqa: E731
    early = complete(client, max_tokens=100, extra_body=STOP_AT_ONCE)  # charged 5 + 100, used 5 + 1
    assert early.usage.completion_tokens == 1 and early.choices[0].finish_reason == "stop"
    assert left() >= 120 - 6 - 1  # refunded at once; without the refund 15 + 2/s
    streamed = list(complete(client, max_tokens=100, stream=True, extra_body={"ignore_eos": True}))
    assert streamed[-1].choices[0].finish_reason == "length" and left() < 120 - 100  # used it all
    e = rate_limit_error(complete, client, max_tokens=100, extra_body={"ignore_eos": True})
    assert "120 tokens per minute" in e.body["message"] and "needs 105 tokens" in e.body["message"]
    assert int(e.response.headers["retry-after"]) >= 30
    never = rate_limit_error(complete, client, max_tokens=200, n=1)
    assert "can never fit" in never.body["message"] and "retry-after" not in never.response.headers
    assert never.response.headers["x-should-retry"] == "false"
    assert metric(server, 'jaxinfer_rate_limited_total{limit="tpm"}') == 2


def test_concurrent_requests_per_key(serve):
    server = serve(http_port=0, api_keys=("sk-a", "sk-b"), rate_limits=RateLimits(max_concurrent=1))
    a, b = openai_client(server, "sk-a"), openai_client(server, "sk-b")
    with slow_steps(server.server.engine_loop.engine, 0.05):
        stream = complete(a, max_tokens=200, stream=True, extra_body={"ignore_eos": True})
        wait_for(lambda: server.server.http.num_in_flight == 1)
        e = rate_limit_error(complete, a, max_tokens=2)
        assert "1 concurrent requests" in e.body["message"] and e.response.headers["retry-after"] == "1"
        assert complete(b, max_tokens=2).usage.completion_tokens == 2
        stream.close()
        wait_for(lambda: server.server.http.num_in_flight == 0)
    assert complete(a, max_tokens=2).usage.completion_tokens == 2


def test_one_limiter_for_both_transports(serve):
    """No API keys: HTTP takes the gRPC token as its key, so both draw on that key's budget."""
    server = serve(http_port=0, auth_token="tok", rate_limits=RateLimits(requests_per_minute=3))
    client = openai_client(server, "tok")
    with client_of(server, token="tok") as grpc_client:
        assert len(grpc_client.generate([1, 2], max_tokens=2, ignore_eos=True, timeout=30).token_ids) == 2
        assert complete(client, max_tokens=2).usage.completion_tokens == 2
        assert len(grpc_client.generate([1, 2], max_tokens=2, ignore_eos=True, timeout=30).token_ids) == 2
        with pytest.raises(grpc.RpcError) as info:
            grpc_client.generate([1, 2], max_tokens=2, timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "3 requests per minute" in info.value.details()
        assert 15 <= int(dict(info.value.trailing_metadata())["retry-after"]) <= 20
    rate_limit_error(complete, client, max_tokens=2)  # HTTP's budget is gone too
    assert server.server.limiter.available(key_id("tok"))["rpm"] < 1
    assert metric(server, 'jaxinfer_rate_limited_total{limit="rpm"}') == 2


def test_grpc_tokens_per_minute_and_refund(serve):
    server = serve(auth_token="tok", rate_limits=RateLimits(tokens_per_minute=60))  # 1 per second
    with client_of(server, token="tok") as grpc_client:
        result = grpc_client.generate([1, 2, 3], max_tokens=50, timeout=30, **STOP_AT_ONCE)
        assert len(result.token_ids) == 1
        assert server.server.limiter.available(key_id("tok"))["tpm"] >= 60 - 4 - 1
        grpc_client.generate([1, 2, 3], max_tokens=50, ignore_eos=True, timeout=30)
        with pytest.raises(grpc.RpcError) as info:
            grpc_client.generate([1, 2, 3], max_tokens=50, ignore_eos=True, timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tokens per minute" in info.value.details()
        assert int(dict(info.value.trailing_metadata())["retry-after"]) >= 30
        with pytest.raises(grpc.RpcError) as info:
            grpc_client.generate([1, 2, 3], max_tokens=100, timeout=30)
        assert "can never fit" in info.value.details() and "retry-after" not in dict(info.value.trailing_metadata())


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_request_log_of_both_transports_without_secrets(serve, tmp_path):
    path = tmp_path / "requests.jsonl"
    secrets = ("sk-http-secret", "grpc-secret-token")
    server = serve(
        http_port=0,
        api_keys=(secrets[0],),
        auth_token=secrets[1],
        request_log=str(path),
        rate_limits=RateLimits(requests_per_minute=5),
    )
    client = openai_client(server, secrets[0])
    complete(client, max_tokens=3, user="alice", extra_body={"ignore_eos": True})
    list(complete(client, max_tokens=2, stream=True, n=2, extra_body={"ignore_eos": True}))
    with pytest.raises(openai.BadRequestError):
        complete(client, max_tokens=3, temperature=-1.5)
    with client_of(server, token=secrets[1]) as grpc_client:
        grpc_client.generate([7, 8, 9], max_tokens=4, ignore_eos=True, timeout=30)
        with pytest.raises(grpc.RpcError):
            grpc_client.generate([7, 8, 9], max_tokens=400, timeout=30)  # longer than the context
    for _ in range(3):
        try:
            complete(client, max_tokens=1)
        except openai.RateLimitError:
            pass
    wait_for(lambda: len(path.read_text().splitlines()) == 8)  # each written just after its answer
    server.stop()
    text = path.read_text()
    assert not any(s in text for s in secrets) and "Bearer" not in text
    lines = _lines(path)
    http_ok, streamed, bad, grpc_ok, grpc_bad, *rest = lines
    assert len(lines) == 8 and [line["status"] for line in rest] == [200, 200, 429]
    assert http_ok["transport"] == "http" and http_ok["route"] == "/v1/completions" and http_ok["status"] == 200
    assert http_ok["key_id"] == key_id(secrets[0]) and http_ok["user"] == "alice" and http_ok["model"] == "llama3"
    assert http_ok["request_id"].startswith("cmpl-") and http_ok["finish_reasons"] == ["length"]
    assert (http_ok["prompt_tokens"], http_ok["completion_tokens"]) == (5, 3)
    assert 0 < http_ok["ttft_s"] <= http_ok["e2e_s"]
    assert streamed["completion_tokens"] == 4 and streamed["finish_reasons"] == ["length", "length"]
    assert bad["status"] == 400 and bad["error"].startswith("temperature") and "-1.5" not in bad["error"]
    assert grpc_ok["transport"] == "grpc" and grpc_ok["route"].endswith("/Generate") and grpc_ok["status"] == "OK"
    assert grpc_ok["key_id"] == key_id(secrets[1]) and grpc_ok["completion_tokens"] == 4
    assert grpc_bad["status"] == "INVALID_ARGUMENT" and grpc_bad["error"].startswith("sampling.max_tokens")
    assert "requests per minute" in rest[-1]["error"] and rest[-1]["request_id"] is None
    assert not any("prompt" in line or "outputs" in line for line in lines)


def test_request_log_with_prompts(serve, tmp_path):
    path = tmp_path / "requests.jsonl"
    server = serve(http_port=0, request_log=str(path), log_prompts=True)
    complete(openai_client(server, "none"), prompt=[11, 12, 13], max_tokens=3, extra_body={"ignore_eos": True})
    with client_of(server) as grpc_client:
        out = grpc_client.generate([21, 22], max_tokens=2, ignore_eos=True, timeout=30)
    wait_for(lambda: len(path.read_text().splitlines()) == 2)
    server.stop()
    http_line, grpc_line = _lines(path)
    assert http_line["key_id"] is None and http_line["prompt"] == [11, 12, 13] and len(http_line["outputs"][0]) == 3
    assert grpc_line["prompt"] == {"ids": [21, 22]} and grpc_line["outputs"] == [list(out.token_ids)]
