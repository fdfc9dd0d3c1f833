"""The per-key RateLimiter on a fake clock: buckets refill continuously up to their capacity, tokens
are charged and refunded, the concurrency cap, Retry-After values, keys kept apart; the
request log's records (JSON fields, no prompts unless asked); and when the HTTP gate settles a
request (before the end of its answer goes out)."""

import asyncio
import json

import pytest

from jaxinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput, Usage
from serving.limits import (
    ANONYMOUS,
    CONCURRENT,
    RPM,
    TPM,
    RateLimited,
    RateLimiter,
    RateLimits,
    retry_after,
    token_cost,
)
from serving.openai import sse
from serving.openai.admission import Admission
from serving.openai.middleware import Gate
from serving.request_log import RequestLog


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def limiter(clock, **limits):
    refused = []
    return RateLimiter(RateLimits(**limits), clock=clock, on_limited=refused.append), refused


def refusal(fn, *args) -> RateLimited:
    with pytest.raises(RateLimited) as info:
        fn(*args)
    return info.value


def test_requests_per_minute_refill_continuously_up_to_capacity():
    clock = Clock()
    lim, refused = limiter(clock, requests_per_minute=6)  # 0.1 requests per second
    for _ in range(6):
        lim.admit("a").release()
    e = refusal(lim.admit, "a")
    assert (e.limit, e.retry_after_s) == (RPM, 10) and "6 requests per minute" in e.message
    clock.now += 5  # half a request back: still refused, 5 s to go
    assert refusal(lim.admit, "a").retry_after_s == 5
    assert lim.available("a")[RPM] == pytest.approx(0.5)
    clock.now += 5
    lim.admit("a").release()
    assert refusal(lim.admit, "a").retry_after_s == 10
    clock.now += 3600  # a long pause refills to the capacity, no further
    for _ in range(6):
        lim.admit("a").release()
    assert refusal(lim.admit, "a").limit == RPM
    assert refused == [RPM] * 4


def test_tokens_are_charged_at_admission_and_the_unused_part_refunded():
    clock = Clock()
    lim, refused = limiter(clock, tokens_per_minute=120)  # 2 tokens per second
    first = lim.admit("a")
    first.charge(token_cost([10], max_tokens=50, n=2))  # 110
    assert lim.available("a")[TPM] == pytest.approx(10)
    second = lim.admit("a")
    e = refusal(second.charge, 30, "detail")
    assert (e.limit, e.retry_after_s) == (TPM, 10) and "tokens per minute" in e.message and "(detail)" in e.message
    assert second.charged == 0 and lim.available("a")[TPM] == pytest.approx(10)  # a refusal takes nothing
    first.release(used_tokens=10 + 15)  # stopped after 15 tokens: 85 come back
    assert lim.available("a")[TPM] == pytest.approx(95)
    first.release(used_tokens=0)  # twice is once
    assert lim.available("a")[TPM] == pytest.approx(95)
    second.charge(30)
    second.release()  # no usage known: nothing refunded
    assert lim.available("a")[TPM] == pytest.approx(65)
    clock.now += 10
    assert lim.available("a")[TPM] == pytest.approx(85)
    big = lim.admit("a")
    e = refusal(big.charge, 121)
    assert e.retry_after_s is None and "can never fit" in e.message
    big.charge(85)
    big.release(used_tokens=500)  # more than charged (cannot happen): no refund, no debt
    assert lim.available("a")[TPM] == pytest.approx(0)
    assert refused == [TPM, TPM]


def test_refunds_never_overfill_the_bucket():
    clock = Clock()
    lim, _ = limiter(clock, tokens_per_minute=60)
    grant = lim.admit(None)
    grant.charge(50)
    clock.now += 60  # refilled meanwhile
    grant.release(used_tokens=0)
    assert lim.available(None)[TPM] == pytest.approx(60)


def test_concurrency_cap_and_a_refused_request_costs_nothing():
    clock = Clock()
    lim, refused = limiter(clock, requests_per_minute=10, max_concurrent=2)
    a1, a2 = lim.admit("a"), lim.admit("a")
    e = refusal(lim.admit, "a")
    assert (e.limit, e.retry_after_s) == (CONCURRENT, 1) and "2 concurrent requests" in e.message
    assert lim.available("a") == {RPM: pytest.approx(8), CONCURRENT: 0}  # the refusal took no request
    a1.release()
    lim.admit("a")
    assert lim.available("a")[CONCURRENT] == 0
    a2.release()
    assert lim.available("a")[CONCURRENT] == 1 and refused == [CONCURRENT]


def test_keys_are_kept_apart_and_none_is_the_anonymous_key():
    clock = Clock()
    lim, _ = limiter(clock, requests_per_minute=1, tokens_per_minute=100, max_concurrent=1)
    a = lim.admit("a")
    a.charge(100)
    assert refusal(lim.admit, "a").limit == RPM
    b = lim.admit("b")  # another key: its own budgets
    b.charge(100)
    anonymous = lim.admit(None)
    assert refusal(lim.admit, "anonymous").limit == RPM and refusal(lim.admit, None).limit == RPM
    assert lim.available("c") == {RPM: 1, TPM: 100, CONCURRENT: 1}
    for grant in (a, b, anonymous):
        grant.release(0)


def test_retry_after_rounds_up_to_whole_seconds_at_least_one():
    assert [retry_after(s) for s in (0.0, 0.2, 1.0, 1.01, 29.5, 30.0)] == [1, 1, 1, 2, 30, 30]
    clock = Clock()
    lim, _ = limiter(clock, requests_per_minute=7)  # 7/60 per second: 8.57 s per request
    for _ in range(7):
        lim.admit("a")
    assert refusal(lim.admit, "a").retry_after_s == 9
    clock.now += 8.57
    assert refusal(lim.admit, "a").retry_after_s == 1


def test_no_limits_keep_no_state_and_bad_limits_are_named():
    lim = RateLimiter()
    grants = [lim.admit("a") for _ in range(1000)]
    for grant in grants:
        grant.charge(10**9)
        grant.release(0)
    assert lim.available("a") == {}
    for field in ("requests_per_minute", "tokens_per_minute", "max_concurrent"):
        with pytest.raises(ValueError, match=field):
            RateLimits(**{field: 0})


def _delta(completion_tokens, text, token_ids, finish=None, index=0):
    return RequestOutput(
        "r",
        None,
        [1, 2],
        [CompletionOutput(index, text, token_ids, finish_reason=finish)],
        finish is not None,
        Usage(2, completion_tokens),
        RequestMetrics(0.0),
    )


def test_request_log_lines(tmp_path):
    clock = Clock()
    path = tmp_path / "requests.jsonl"
    for log_prompts in (False, True):
        log = RequestLog(str(path), log_prompts, model="m", clock=clock)
        record = log.start("http", "/v1/completions", "1a2b3c4d")
        record.request_id, record.user, record.prompt_tokens = "cmpl-1", "u", 2
        if record.keep_text:
            record.prompt = "Hello"
        clock.now += 0.25
        record.observe(0, _delta(1, " wor", [5]))
        clock.now += 0.5
        record.observe(0, _delta(2, "ld", [6], finish="stop"))
        record.error = "temperature=-1: must be >= 0"
        log.finish(record, 400)
        log.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 2
    plain, full = lines
    assert plain["time"].endswith("Z") and {
        k: plain[k]
        for k in (
            "request_id",
            "transport",
            "route",
            "key_id",
            "model",
            "status",
            "prompt_tokens",
            "completion_tokens",
            "ttft_s",
            "e2e_s",
            "finish_reasons",
            "user",
        )
    } == {
        "request_id": "cmpl-1",
        "transport": "http",
        "route": "/v1/completions",
        "key_id": "1a2b3c4d",
        "model": "m",
        "status": 400,
        "prompt_tokens": 2,
        "completion_tokens": 2,
        "ttft_s": 0.25,
        "e2e_s": 0.75,
        "finish_reasons": ["stop"],
        "user": "u",
    }
    assert "prompt" not in plain and "outputs" not in plain and "-1" not in plain["error"]  # no content quoted
    assert plain["error"].startswith("temperature")
    assert full["prompt"] == "Hello" and full["outputs"] == [" world"] and full["error"].endswith("must be >= 0")


@pytest.mark.parametrize("stream", [False, True])
def test_the_http_gate_refunds_before_the_end_of_the_answer(stream):
    """A client that has its whole answer sees the refund and its request-log line: both happen
    before the last body message (a stream: its `[DONE]` event) goes out, not after the app
    returns (a client's next request may come first)."""
    clock = Clock()
    lim, _ = limiter(clock, tokens_per_minute=120)
    admission = Admission(8, limiter=lim)
    seen, logged = [], []

    class Log(RequestLog):
        def finish(self, record, status):
            logged.append((status, record.total_tokens))

    async def app(scope, receive, send):
        state = scope["state"]
        state["record"].prompt_tokens = 5
        state["grant"].charge(105)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if stream:  # what a StreamingResponse sends: events, [DONE], then an empty last message
            await send({"type": "http.response.body", "body": sse.event({}), "more_body": True})
            await send({"type": "http.response.body", "body": sse.DONE, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            await send({"type": "http.response.body", "body": b"{}"})
        await asyncio.sleep(0)  # the app's own teardown: the client already has the answer

    async def send(message):
        if message["type"] == "http.response.body" and message["body"] in (b"{}", sse.DONE):
            seen.append((lim.available(ANONYMOUS)["tpm"], admission.in_flight, list(logged)))

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    scope = {"type": "http", "path": "/v1/completions", "method": "POST", "headers": []}
    gate = Gate(app, admission=admission, max_body_bytes=1 << 20, request_log=Log())
    asyncio.run(gate(scope, receive, send))
    # 120 - 105 charged + 100 refunded, the slot already free, the line written
    assert seen == [(115, 0, [(200, 5)])]
    assert admission.in_flight == 0 and lim.available(ANONYMOUS)["tpm"] == 115  # released once
    assert logged == [(200, 5)]  # written once
