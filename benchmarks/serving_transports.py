"""The transports bench_serving.py streams requests over: gRPC (serving.grpc.client.AsyncClient) and
the OpenAI-compatible HTTP API (POST /v1/completions with `stream: true`, over httpx2).

Both send the same request: the prompt as token ids, max_tokens, temperature 0, ignore_eos. Both
time the same things on the client, with time.perf_counter():

    sent   before the call starts (gRPC: the stub call; HTTP: the POST, connection from the pool)
    TTFT   sent -> the first message carrying tokens: a GenerateResponse with token ids / an SSE
           chunk whose choice has text (each `data:` line is stamped as the client reads it)
    ITL    the gaps between consecutive messages carrying tokens (`messages` counts them)
    E2E    sent -> the end of the stream (gRPC: the last response; HTTP: `data: [DONE]`)

Transport overhead: the server's request log (`jaxinfer serve --request-log`) records each
request's TTFT from the moment its handler starts to the moment the handler sees its first
token (`ttft_s`). The client's TTFT minus that, matched by request id (gRPC: the responses'
request_id; HTTP: the chunks' `id`), is what the transport itself costs the request: connection,
serialisation, parsing and the wire, both ways. Engine-side noise (which step a request lands
in, decode-window alignment) is in both terms and cancels, so this resolves milliseconds where
the raw TTFTs of two runs differ by tens.

Output tokens: gRPC counts the token ids the responses carry; an SSE chunk carries text, not
ids, so HTTP asks for `stream_options.include_usage` and takes the final chunk's
usage.completion_tokens. Either way a request that did not produce exactly max_tokens tokens is
counted as failed ("output N tokens, max_tokens M"), so the two transports never silently
measure different work.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from pathlib import Path

from serving.grpc.client import AsyncClient


@dataclasses.dataclass
class RequestSpec:
    prompt: list[int]
    max_tokens: int


@dataclasses.dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    messages: int = 0  # streamed messages that carried tokens
    wrong_length: bool = False  # the stream ended with output_tokens != max_tokens
    ttft: float = math.nan
    e2e: float = math.nan
    itls: list[float] = dataclasses.field(default_factory=list)
    error: str = ""
    request_id: str = ""  # the server's id for it (gRPC responses' request_id, HTTP chunks' id)


class _Clock:
    """One request's timestamps, kept in its RequestResult."""

    def __init__(self, result: RequestResult):
        self.result = result
        self.sent = self.last = time.perf_counter()

    def tokens_arrived(self) -> None:
        now = time.perf_counter()
        if self.result.messages == 0:
            self.result.ttft = now - self.sent
        else:
            self.result.itls.append(now - self.last)
        self.last = now
        self.result.messages += 1

    def finished(self, spec: RequestSpec) -> None:
        self.result.e2e = time.perf_counter() - self.sent
        if self.result.output_tokens != spec.max_tokens:
            self.result.wrong_length = True
            self.result.error = f"output {self.result.output_tokens} tokens, max_tokens {spec.max_tokens}"
        else:
            self.result.ok = True


class GrpcTransport:
    name = "grpc"

    def __init__(self, address: str, token: str | None):
        self.client = AsyncClient(address, token=token)

    async def model_info(self) -> tuple[str, int]:
        info = await self.client.model_info()
        return info.model, info.max_model_len

    async def tokenize(self, text: str) -> list[int]:
        return await self.client.tokenize(text, add_special_tokens=False)

    async def run_one(self, spec: RequestSpec, timeout: float) -> RequestResult:
        result = RequestResult(ok=False, prompt_tokens=len(spec.prompt))
        clock = _Clock(result)
        try:
            async for msg in self.client.stream(
                spec.prompt, max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True, timeout=timeout
            ):
                result.request_id = result.request_id or msg.request_id
                n = sum(len(d.token_ids) for d in msg.outputs)
                if n:
                    clock.tokens_arrived()
                    result.output_tokens += n
            clock.finished(spec)
        except Exception as e:  # noqa: BLE001 (a failed request is counted, not fatal)
            details = e.details() if hasattr(e, "details") else e  # grpc.RpcError's message
            result.error = f"{type(e).__name__}: {details}"
        return result

    async def close(self) -> None:
        await self.client.close()


class HttpError(Exception):
    pass


class HttpTransport:
    name = "http"

    def __init__(self, base_url: str, token: str | None):
        import httpx2  # the async client the `openai` package is built on

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # one connection per stream in flight (HTTP/1.1), all kept (uvicorn closes those idle > 5 s: a
        # new one costs a loopback connect in that request's TTFT); no proxies
        limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=None)
        self.client = httpx2.AsyncClient(
            base_url=base_url, headers=headers, limits=limits, trust_env=False, timeout=httpx2.Timeout(600.0)
        )
        self.model = ""  # the name /v1/models gives (model_info)

    async def model_info(self) -> tuple[str, int]:
        card = (await self._json("GET", "/v1/models"))["data"][0]
        self.model = card["id"]
        return card["id"], card.get("max_model_len", 0)

    async def tokenize(self, text: str) -> list[int]:
        return (await self._json("POST", "/tokenize", {"prompt": text, "add_special_tokens": False}))["tokens"]

    async def _json(self, method: str, path: str, body: dict | None = None) -> dict:
        response = await self.client.request(method, path, json=body)
        if response.status_code != 200:
            raise HttpError(f"{method} {path}: HTTP {response.status_code}: {response.text[:300]}")
        return response.json()

    async def run_one(self, spec: RequestSpec, timeout: float) -> RequestResult:
        result = RequestResult(ok=False, prompt_tokens=len(spec.prompt))
        body = {
            "model": self.model,
            "prompt": spec.prompt,
            "max_tokens": spec.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        clock = _Clock(result)
        try:
            async with asyncio.timeout(timeout):
                await self._stream(body, clock)
            clock.finished(spec)
        except Exception as e:  # noqa: BLE001 (a failed request is counted, not fatal)
            result.error = f"{type(e).__name__}: {e}"
        return result

    async def _stream(self, body: dict, clock: _Clock) -> None:
        async with self.client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                raise HttpError(f"HTTP {response.status_code}: {text[:300]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    raise HttpError(chunk["error"].get("message", chunk["error"]))
                clock.result.request_id = clock.result.request_id or chunk.get("id", "")
                if any(choice.get("text") for choice in chunk.get("choices") or ()):
                    clock.tokens_arrived()
                if chunk.get("usage"):
                    clock.result.output_tokens = chunk["usage"]["completion_tokens"]
        raise HttpError("the stream ended without `data: [DONE]`")

    async def close(self) -> None:
        await self.client.aclose()


def server_ttfts(request_log: str | Path, request_ids: set[str], wait_s: float = 10.0) -> dict[str, float]:
    """{request id: the server's ttft_s} for these ids from a request log (JSON lines); waits up to
    `wait_s` for the last ones (a record is written when its handler finishes, just after the
    client has read the end of its stream)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = {}
        for line in Path(request_log).read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("request_id") in request_ids and record.get("ttft_s") is not None:
                found[record["request_id"]] = float(record["ttft_s"])
        if len(found) == len(request_ids) or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def ttft_overheads(results: list[RequestResult], request_log: str | Path) -> list[float]:
    """Client TTFT minus the server's, per successful request found in the log (seconds)."""
    ok = [r for r in results if r.ok and r.request_id]
    server = server_ttfts(request_log, {r.request_id for r in ok})
    return [r.ttft - server[r.request_id] for r in ok if r.request_id in server]
