"""benchmarks/bench_serving.py's HTTP side without a server: the SSE stream of /v1/completions
as the server writes it (a mock transport), token counting and its check, the comparison rows."""

import asyncio
import json
import sys
from pathlib import Path

import httpx2

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_serving
from serving_transports import HttpTransport, RequestResult, RequestSpec, ttft_overheads


def _chunk(text=None, finish=None, usage=None) -> bytes:
    choices = [] if text is None else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
    body = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": choices, "usage": usage}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _run(events: bytes, spec: RequestSpec, status: int = 200):
    sent = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        sent.append(json.loads(request.content))
        return httpx2.Response(status, content=events, headers={"content-type": "text/event-stream"})

    async def go():
        transport = HttpTransport("http://bench.invalid", token="sk-1")
        await transport.client.aclose()
        transport.client = httpx2.AsyncClient(base_url="http://bench.invalid", transport=httpx2.MockTransport(handler))
        transport.model = "m"
        try:
            return await transport.run_one(spec, timeout=10)
        finally:
            await transport.close()

    return asyncio.run(go()), sent


def test_http_stream_is_timed_per_chunk_with_text_and_counted_by_usage():
    events = (
        _chunk("Hello")
        + _chunk(" wor")
        + _chunk("")
        + _chunk("ld")
        + _chunk("", finish="length")
        + _chunk(usage={"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7})
        + b"data: [DONE]\n\n"
    )
    result, sent = _run(events, RequestSpec([5, 6, 7], 4))
    assert result.ok and not result.error, result.error
    assert (result.output_tokens, result.messages, len(result.itls)) == (4, 3, 2)  # empty texts carry no tokens
    assert 0 <= result.ttft <= result.e2e
    assert result.request_id == "cmpl-1"  # the chunks' id: matched against the server's request log
    assert sent == [
        {
            "model": "m",
            "prompt": [5, 6, 7],
            "max_tokens": 4,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ]


def test_http_requests_with_other_work_or_errors_fail():
    short = _chunk("Hi") + _chunk(usage={"completion_tokens": 3}) + b"data: [DONE]\n\n"
    result, _ = _run(short, RequestSpec([1], 4))
    assert not result.ok and result.wrong_length and result.error == "output 3 tokens, max_tokens 4"
    no_usage, _ = _run(_chunk("Hi") + b"data: [DONE]\n\n", RequestSpec([1], 4))
    assert not no_usage.ok and no_usage.wrong_length  # include_usage is how HTTP tokens are counted
    error = _chunk("Hi") + b'data: {"error": {"message": "engine failed"}}\n\n' + b"data: [DONE]\n\n"
    failed, _ = _run(error, RequestSpec([1], 4))
    assert not failed.ok and not failed.wrong_length and "engine failed" in failed.error
    refused, _ = _run(b'{"error": {"message": "prompt: too long"}}', RequestSpec([1], 4), status=400)
    assert not refused.ok and "HTTP 400" in refused.error and "too long" in refused.error


def test_comparison_rows_and_arguments():
    def row(transport, itl, ttft, tokens=40, failed=0, overhead=float("nan")):
        return {
            "transport": transport,
            "rate": 2.0,
            "failed": failed,
            "output_tokens": tokens,
            "messages": 9,
            "itl_ms": {50: itl},
            "ttft_ms": {50: ttft},
            "ttft_overhead_ms": {50: overhead},
        }

    (c,) = bench_serving.compare([row("grpc", 100.0, 50.0), row("http", 104.0, 58.0)])
    assert abs(c["itl_p50_ratio"] - 1.04) < 1e-9 and c["ttft_p50_diff_ms"] == 8.0 and c["within_goal"]
    # With the request log's overheads, they decide: raw TTFTs 30 ms apart, overheads 2 ms apart.
    (c,) = bench_serving.compare([row("grpc", 100.0, 50.0, overhead=1.0), row("http", 100.0, 80.0, overhead=3.0)])
    assert c["ttft_added_ms"] == 2.0 and c["within_goal"]
    (c,) = bench_serving.compare([row("grpc", 100.0, 50.0, overhead=1.0), row("http", 100.0, 51.0, overhead=12.0)])
    assert c["ttft_added_ms"] == 11.0 and not c["within_goal"]
    (c,) = bench_serving.compare([row("grpc", 100.0, 50.0), row("http", 100.0, 50.0, tokens=39, failed=1)])
    assert not c["same_work"] and not c["within_goal"]
    assert "| 2 | 1.000 | +0.0 | +nan | 40 / 39 | 9 / 9 | no: different work" in bench_serving.markdown_comparison([c])
    assert bench_serving.listening_addresses("listening on 127.0.0.1:5 (http://127.0.0.1:6)\n") == (
        "127.0.0.1:5",
        "http://127.0.0.1:6",
    )
    assert bench_serving.parse_args(["--http"]).transports == ["grpc", "http"]
    assert bench_serving.parse_args([]).transports == ["grpc"]


def test_ttft_overhead_is_client_minus_server_per_request(tmp_path):
    log = tmp_path / "requests.jsonl"
    records = [
        {"request_id": "a", "ttft_s": 0.100},
        {"request_id": "b", "ttft_s": 0.200},
        {"request_id": "c", "ttft_s": None},
        {"request_id": "other", "ttft_s": 9.0},
    ]
    log.write_text("".join(json.dumps(r) + "\n" for r in records) + "not json\n")
    results = [
        RequestResult(ok=True, prompt_tokens=1, ttft=0.104, request_id="a"),
        RequestResult(ok=True, prompt_tokens=1, ttft=0.207, request_id="b"),
        RequestResult(ok=False, prompt_tokens=1, ttft=0.5, request_id="c"),
    ]  # failed: not counted
    overheads = ttft_overheads(results, log)
    assert [round(x, 6) for x in overheads] == [0.004, 0.007]
