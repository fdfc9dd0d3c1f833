"""Python clients of jaxinfer.v1.InferenceService: `Client` (blocking) and `AsyncClient` (asyncio).

    with Client("127.0.0.1:50051", token=...) as client:
        result = client.generate("Hello", max_tokens=32, temperature=0)    # accumulated
        for msg in client.stream([1, 2, 3], max_tokens=8): ...              # GenerateResponse deltas
        client.generate(messages=[{"role": "user", "content": "Hi"}])       # chat template
        client.generate(messages=..., tools=[...], tool_choice="required").outputs[0].tool_calls
        client.generate([1, 2, 3], lora_adapter="sql")                      # under a LoRA adapter
        client.load_lora_adapter("sql", "/adapters/sql"); client.list_lora_adapters().adapters
        client.unload_lora_adapter("sql")

Sampling options are keyword arguments named as in SamplingParams (and the proto's
SamplingOptions); leaving one out takes the server's default. `lora_adapter` names the LoRA
adapter a generate call runs under (the server's --lora-modules or one loaded since); loading and
unloading need a server started with --allow-runtime-lora-updating. Failures raise grpc.RpcError with
the server's status code and message. Leaving a stream early cancels the call, which aborts the
request on the server and frees its KV pages.

    keyword arguments -> client_messages.build_request -> stub.Generate (channel: TLS, bearer
    token metadata) -> GenerateResponse deltas -> client_messages.Accumulator -> GenerateResult
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from typing import Any  # the calls' **kwargs: build_request's keyword arguments, passed on

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.grpc.client_messages import (
    Accumulator,
    Completion,
    GenerateResult,
    Prompt,
    build_request,
    tokenize_request,
)
from serving.grpc.proto import jaxinfer_pb2 as pb
from serving.grpc.proto import jaxinfer_pb2_grpc as pb_grpc

# The request and result types live in client_messages.py; importable from here, beside the clients.
__all__ = ["Accumulator", "AsyncClient", "Client", "Completion", "GenerateResult", "Prompt", "build_request"]


def _channel_args(max_message_bytes: int) -> list[tuple[str, int | str]]:
    return [("grpc.max_receive_message_length", max_message_bytes), ("grpc.max_send_message_length", max_message_bytes)]


class _Base:
    def __init__(
        self, target: str, token: str | None, root_certificates: bytes | None, tls_server_name: str | None, tls: bool
    ):
        self.target = target
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._tls = tls or root_certificates is not None
        self._creds = grpc.ssl_channel_credentials(root_certificates=root_certificates) if self._tls else None
        self._options = _channel_args(64 * 1024 * 1024)
        if tls_server_name:
            self._options.append(("grpc.ssl_target_name_override", tls_server_name))


class Client(_Base):
    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        token: str | None = None,
        root_certificates: bytes | None = None,
        tls_server_name: str | None = None,
        tls: bool = False,
    ):
        super().__init__(target, token, root_certificates, tls_server_name, tls)
        self.channel = (
            grpc.secure_channel(target, self._creds, self._options)
            if self._tls
            else grpc.insecure_channel(target, self._options)
        )
        self.stub = pb_grpc.InferenceServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def stream(
        self, prompt: Prompt | None = None, *, timeout: float | None = None, **kwargs: Any
    ) -> Iterator[pb.GenerateResponse]:
        call = self.stub.Generate(build_request(prompt, **kwargs), timeout=timeout, metadata=self._metadata)
        try:
            yield from call
        finally:
            call.cancel()  # a no-op once finished; aborts the request when the caller stops early

    def generate(self, prompt: Prompt | None = None, *, timeout: float | None = None, **kwargs: Any) -> GenerateResult:
        acc = Accumulator()
        for msg in self.stream(prompt, timeout=timeout, **kwargs):
            acc.add(msg)
        return acc.result()

    def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Iterable[dict] | None = None,
        add_special_tokens: bool = True,
        timeout: float | None = None,
    ) -> list[int]:
        request = tokenize_request(text, messages, add_special_tokens)
        return list(self.stub.Tokenize(request, timeout=timeout, metadata=self._metadata).token_ids)

    def detokenize(
        self, token_ids: Sequence[int], *, skip_special_tokens: bool = True, timeout: float | None = None
    ) -> str:
        request = pb.DetokenizeRequest(token_ids=list(token_ids), skip_special_tokens=skip_special_tokens)
        return self.stub.Detokenize(request, timeout=timeout, metadata=self._metadata).text

    def model_info(self, timeout: float | None = None) -> pb.GetModelInfoResponse:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, metadata=self._metadata)

    def server_stats(self, timeout: float | None = None) -> pb.GetServerStatsResponse:
        return self.stub.GetServerStats(pb.GetServerStatsRequest(), timeout=timeout, metadata=self._metadata)

    def list_lora_adapters(self, timeout: float | None = None) -> pb.ListLoraAdaptersResponse:
        return self.stub.ListLoraAdapters(pb.ListLoraAdaptersRequest(), timeout=timeout, metadata=self._metadata)

    def load_lora_adapter(self, name: str, path: str, timeout: float | None = None) -> pb.LoraAdapter:
        """Loads the PEFT adapter directory `path` (on the server) as `name`; its description."""
        request = pb.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
        return self.stub.LoadLoraAdapter(request, timeout=timeout, metadata=self._metadata)

    def unload_lora_adapter(self, name: str, timeout: float | None = None) -> None:
        request = pb.UnloadLoraAdapterRequest(lora_name=name)
        self.stub.UnloadLoraAdapter(request, timeout=timeout, metadata=self._metadata)

    def health(self, service: str = "", timeout: float | None = None) -> str:
        reply = self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Base):
    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        token: str | None = None,
        root_certificates: bytes | None = None,
        tls_server_name: str | None = None,
        tls: bool = False,
    ):
        super().__init__(target, token, root_certificates, tls_server_name, tls)
        self.channel = (
            grpc.aio.secure_channel(target, self._creds, self._options)
            if self._tls
            else grpc.aio.insecure_channel(target, self._options)
        )
        self.stub = pb_grpc.InferenceServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    async def stream(
        self, prompt: Prompt | None = None, *, timeout: float | None = None, **kwargs: Any
    ) -> AsyncIterator[pb.GenerateResponse]:
        call = self.stub.Generate(build_request(prompt, **kwargs), timeout=timeout, metadata=self._metadata)
        try:
            async for msg in call:
                yield msg
        finally:
            call.cancel()

    async def generate(
        self, prompt: Prompt | None = None, *, timeout: float | None = None, **kwargs: Any
    ) -> GenerateResult:
        acc = Accumulator()
        async for msg in self.stream(prompt, timeout=timeout, **kwargs):
            acc.add(msg)
        return acc.result()

    async def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Iterable[dict] | None = None,
        add_special_tokens: bool = True,
        timeout: float | None = None,
    ) -> list[int]:
        request = tokenize_request(text, messages, add_special_tokens)
        reply = await self.stub.Tokenize(request, timeout=timeout, metadata=self._metadata)
        return list(reply.token_ids)

    async def detokenize(
        self, token_ids: Sequence[int], *, skip_special_tokens: bool = True, timeout: float | None = None
    ) -> str:
        request = pb.DetokenizeRequest(token_ids=list(token_ids), skip_special_tokens=skip_special_tokens)
        return (await self.stub.Detokenize(request, timeout=timeout, metadata=self._metadata)).text

    async def model_info(self, timeout: float | None = None) -> pb.GetModelInfoResponse:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, metadata=self._metadata)

    async def server_stats(self, timeout: float | None = None) -> pb.GetServerStatsResponse:
        return await self.stub.GetServerStats(pb.GetServerStatsRequest(), timeout=timeout, metadata=self._metadata)

    async def list_lora_adapters(self, timeout: float | None = None) -> pb.ListLoraAdaptersResponse:
        request = pb.ListLoraAdaptersRequest()
        return await self.stub.ListLoraAdapters(request, timeout=timeout, metadata=self._metadata)

    async def load_lora_adapter(self, name: str, path: str, timeout: float | None = None) -> pb.LoraAdapter:
        request = pb.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
        return await self.stub.LoadLoraAdapter(request, timeout=timeout, metadata=self._metadata)

    async def unload_lora_adapter(self, name: str, timeout: float | None = None) -> None:
        request = pb.UnloadLoraAdapterRequest(lora_name=name)
        await self.stub.UnloadLoraAdapter(request, timeout=timeout, metadata=self._metadata)

    async def health(self, service: str = "", timeout: float | None = None) -> str:
        reply = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
