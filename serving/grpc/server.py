"""GrpcServer: the grpc.aio listener of one InferenceServicer, and its life cycle.

    bind():    the port (add_insecure_port / add_secure_port with TLS), before anything starts,
               so a taken port fails at once; SO_REUSEPORT off, so a second server on a taken
               port fails instead of sharing it
    start():   InferenceService, the standard health service and server reflection, behind the
               bearer-token interceptor when a token is set
    serving(): health SERVING for "" and the service (once every transport is up)
    stop():    health NOT_SERVING and new calls refused at once (UNAVAILABLE); in-flight calls get
               the grace period, then the server closes

serving.server.InferenceServer owns it beside the HTTP API and decides when each step happens.
"""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from serving.grpc.auth import BearerTokenInterceptor
from serving.grpc.proto import jaxinfer_pb2 as pb
from serving.grpc.proto import jaxinfer_pb2_grpc as pb_grpc
from serving.grpc.servicer import InferenceServicer

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name  # jaxinfer.v1.InferenceService


@dataclasses.dataclass(frozen=True)
class GrpcOptions:
    host: str = "127.0.0.1"
    port: int = 50051  # 0: any free port (see GrpcServer.port)
    auth_token: str | None = None  # bearer token every call but health checks must carry
    tls_cert_file: str | None = None  # PEM certificate chain and key: TLS instead of plaintext
    tls_key_file: str | None = None
    max_message_bytes: int = 4 * 1024 * 1024


class GrpcServer:
    def __init__(self, servicer: InferenceServicer, options: GrpcOptions):
        self.servicer, self.options = servicer, options
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self._server = self._build()
        self._closing: asyncio.Task | None = None

    @property
    def address(self) -> str:
        return f"{self.options.host}:{self.port}"

    def _build(self) -> grpc.aio.Server:
        opts = self.options
        interceptors = [BearerTokenInterceptor(opts.auth_token)] if opts.auth_token else []
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", opts.max_message_bytes),
                ("grpc.max_send_message_length", opts.max_message_bytes),
                ("grpc.so_reuseport", 0),
            ],
        )  # a second server on a taken port fails instead of sharing it
        pb_grpc.add_InferenceServiceServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        return server

    def bind(self) -> int:
        opts = self.options
        address = f"{opts.host}:{opts.port}"
        try:
            if opts.tls_cert_file:
                if opts.tls_key_file is None:
                    raise ValueError("GrpcOptions.tls_cert_file needs tls_key_file (the certificate's key)")
                with open(opts.tls_key_file, "rb") as k, open(opts.tls_cert_file, "rb") as c:
                    creds = grpc.ssl_server_credentials([(k.read(), c.read())])
                port = self._server.add_secure_port(address, creds)
            else:
                port = self._server.add_insecure_port(address)
        except RuntimeError as e:
            raise OSError(f"cannot listen on {address}: {e}") from None
        if not port:
            raise OSError(f"cannot listen on {address}")
        self.port = port
        return port

    async def start(self) -> None:
        await self._server.start()

    async def serving(self) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def begin_stopping(self, grace: float) -> None:
        """Health NOT_SERVING and new calls refused now; in-flight ones get `grace` seconds."""
        await self.health.enter_graceful_shutdown()
        self._closing = asyncio.create_task(self._server.stop(grace))

    async def stopped(self) -> None:
        if self._closing is not None:
            await self._closing

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()
