"""InferenceServer: one Engine behind the gRPC server (serving.grpc) and/or the OpenAI-compatible
HTTP API (serving.openai, uvicorn on the same event loop), and their life cycle. The one module
that knows both transports; neither imports the other.

    start():  sockets bound -> EngineLoop thread up -> the grpc.aio server (InferenceService,
              health, reflection; bearer-token interceptor and TLS when configured: GrpcServer)
              -> the HTTP API -> health SERVING -> Prometheus /metrics on its own port when
              asked for
    stop():   health NOT_SERVING, new gRPC calls refused (UNAVAILABLE), new HTTP requests 503
              -> in-flight calls and requests of both get `grace_period_s` to finish -> the
              engine loop stops, ending what is left (UNAVAILABLE / 503 / an error event)
              -> the grpc server and the HTTP server close.

Both transports admit generation requests against one in-flight limit (max_num_seqs +
max_waiting) and one RateLimiter (per-key requests / tokens per minute, concurrency; the key is
the sha256 prefix of the HTTP API key or of the gRPC token, so a gRPC token that is also an API
key shares that key's budgets), and write finished requests to one request log.

BackgroundServer runs the same on an event loop of its own thread, for synchronous programs,
benchmarks and tests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading

from jaxinfer.engine import Engine
from serving.engine_loop import EngineLoop
from serving.grpc.server import GrpcOptions, GrpcServer
from serving.grpc.servicer import InferenceServicer
from serving.kv_events import KVEventPublisher
from serving.limits import RateLimiter, RateLimits
from serving.metrics import ServerMetrics
from serving.openai.admission import Admission
from serving.openai.auth import key_id
from serving.openai.server import DEFAULT_MAX_BODY_BYTES, HttpOptions, HttpServer, served_model_name
from serving.request_log import RequestLog

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int | None = 50051  # 0: any free port (see InferenceServer.port); None: no gRPC
    max_waiting: int = 256  # calls admitted beyond max_num_seqs; past it RESOURCE_EXHAUSTED
    auth_token: str | None = None  # bearer token every call but health checks must carry
    tls_cert_file: str | None = None  # PEM certificate chain and key: serve TLS instead of plaintext
    tls_key_file: str | None = None
    metrics_port: int | None = None  # Prometheus HTTP port; None: off, 0: any free port
    metrics_host: str = "127.0.0.1"
    grace_period_s: float = 10.0  # how long stop() lets in-flight calls finish
    max_message_bytes: int = 4 * 1024 * 1024
    # The OpenAI-compatible HTTP API (serving.openai): off unless http_port is set (0: any free port).
    http_port: int | None = None
    http_host: str = "127.0.0.1"
    ui: bool = True  # the HTTP API serves the playground page at /ui
    lora_updates: bool = False  # LoRA adapters loaded and unloaded while serving (HTTP routes, gRPC calls)
    served_model_name: str | None = None  # None: the model path's basename
    api_keys: tuple[str, ...] = ()  # HTTP `Authorization: Bearer` keys; none: auth_token if set, else open
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    tool_call_parser: str = "auto"  # tool_choice "auto": auto (from the chat template), none, a format
    reasoning_parser: str | None = None  # chat outputs' reasoning split off: qwen3, deepseek_r1; None: not
    rate_limits: RateLimits = RateLimits()  # per key, both transports; default: none
    request_log: str | None = None  # a JSON line per finished generation request: FILE, "-": stderr
    log_prompts: bool = False  # the request log includes prompts and outputs
    # KV events for prefix-aware routers (serving/kv_events.py): tcp://HOST:PORT, rank r on PORT + r
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None  # where past batches are replayed (None: not)

    def __post_init__(self):
        if self.port is None and self.http_port is None:
            raise ValueError("nothing to serve: set a gRPC port, an HTTP port, or both")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("TLS needs both a certificate file and a key file")
        if self.grace_period_s < 0:
            raise ValueError(f"grace_period_s must be >= 0, got {self.grace_period_s}")


class InferenceServer:
    def __init__(self, engine: Engine, options: ServerOptions | None = None):
        self.options = options or ServerOptions()
        opts, name = self.options, self.options.served_model_name or served_model_name(engine.model.path)
        self.metrics = ServerMetrics(name)
        self.metrics.watch_compiles(engine)
        self.kv_events = None
        if opts.kv_events_endpoint is not None:
            self.kv_events = KVEventPublisher(opts.kv_events_endpoint, opts.kv_events_replay_endpoint)
            self.kv_events.attach(engine)
        observers = (self.kv_events.on_step,) if self.kv_events is not None else ()
        self.engine_loop = EngineLoop(engine, self.metrics, observers=observers)
        self._executor = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="jaxinfer-tok")
        self.limiter = RateLimiter(
            opts.rate_limits, on_limited=lambda limit: self.metrics.rate_limited.labels(limit=limit).inc()
        )
        self.request_log = RequestLog(opts.request_log, opts.log_prompts, name)
        self.servicer = InferenceServicer(
            self.engine_loop,
            max_waiting=opts.max_waiting,
            metrics=self.metrics,
            executor=self._executor,
            limiter=self.limiter,
            request_log=self.request_log,
            key_id=key_id(opts.auth_token) if opts.auth_token else None,
            tool_call_parser=opts.tool_call_parser,
            reasoning_parser=opts.reasoning_parser,
        )
        self.servicer.lora_updates = opts.lora_updates
        self.servicer.served_model_name = name
        self.http = self._http_server(self.options.http_port) if self.options.http_port is not None else None
        self.grpc: GrpcServer | None = None  # made in start(): a grpc.aio server belongs to its event loop
        self.metrics_port: int | None = None
        self._started = False

    def _http_server(self, port: int) -> HttpServer:
        opts = self.options
        admission = Admission(self.servicer.max_in_flight, lambda: self.servicer.num_streams, self.limiter)
        self.servicer.in_flight_elsewhere = lambda: admission.in_flight
        keys = opts.api_keys or ((opts.auth_token,) if opts.auth_token else ())
        return HttpServer(
            self.engine_loop,
            self.servicer.limits,
            HttpOptions(
                host=opts.http_host,
                port=port,
                served_model_name=opts.served_model_name,
                api_keys=keys,
                max_body_bytes=opts.max_body_bytes,
                tls_cert_file=opts.tls_cert_file,
                tls_key_file=opts.tls_key_file,
                ui=opts.ui,
                lora_updates=opts.lora_updates,
                kv_events=self.kv_events,
            ),
            admission=admission,
            metrics=self.metrics,
            executor=self._executor,
            request_log=self.request_log,
            tool_parser=self.servicer.tool_parser,
            reasoning=self.servicer.reasoning,
        )

    @property
    def port(self) -> int | None:
        """The gRPC port once bound (None without gRPC)."""
        return self.grpc.port if self.grpc is not None else None

    @property
    def address(self) -> str:
        """The gRPC address, or the HTTP one when there is no gRPC server."""
        if self.options.port is None and self.http is not None:  # one of them: options checked
            return self.http.address
        return f"{self.options.host}:{self.port}"

    async def start(self) -> InferenceServer:
        opts = self.options
        if opts.port is not None:
            self.grpc = GrpcServer(
                self.servicer,
                GrpcOptions(
                    host=opts.host,
                    port=opts.port,
                    auth_token=opts.auth_token,
                    tls_cert_file=opts.tls_cert_file,
                    tls_key_file=opts.tls_key_file,
                    max_message_bytes=opts.max_message_bytes,
                ),
            )
            self.grpc.bind()
        if self.http is not None:
            self.http.bind()
        self.engine_loop.start()
        self._started = True
        if self.grpc is not None:
            await self.grpc.start()
        if self.http is not None:
            await self.http.start()
        if self.grpc is not None:
            await self.grpc.serving()
        if opts.metrics_port is not None:
            self.metrics_port = self.metrics.serve(opts.metrics_port, opts.metrics_host)
        logger.info(
            "serving on %s (%s)%s%s",
            self.address,
            "TLS" if opts.tls_cert_file else "plaintext",
            f", HTTP API on {self.http.url}" if self.http else "",
            f", metrics on :{self.metrics_port}" if self.metrics_port else "",
        )
        return self

    @property
    def num_in_flight(self) -> int:
        return self.servicer.num_streams + (self.http.num_in_flight if self.http else 0)

    async def stop(self, grace: float | None = None) -> None:
        """Stops accepting calls, lets in-flight ones finish within the grace period, ends the rest."""
        if not self._started:
            return
        self._started = False
        grace = self.options.grace_period_s if grace is None else grace
        self.servicer.draining = True
        if self.http is not None:
            self.http.begin_draining()
        if self.grpc is not None:
            await self.grpc.begin_stopping(grace + 5.0)  # refuses new calls at once
        loop = asyncio.get_running_loop()
        end = loop.time() + grace
        while self.num_in_flight and loop.time() < end:
            await asyncio.sleep(0.02)
        if self.num_in_flight:
            logger.warning("grace period over: ending %d calls/requests", self.num_in_flight)
        await asyncio.to_thread(self.engine_loop.stop)
        if self.grpc is not None:
            await self.grpc.stopped()
        if self.http is not None:
            await self.http.stop()
        self.metrics.close()
        self.request_log.close()
        if self.kv_events is not None:
            self.kv_events.close()
        self._executor.shutdown(wait=False)

    async def wait_for_termination(self) -> None:
        if self.grpc is not None:
            await self.grpc.wait_for_termination()


class BackgroundServer:
    """An InferenceServer on its own thread and event loop: `with BackgroundServer(engine) as s:`."""

    def __init__(self, engine: Engine, options: ServerOptions | None = None):
        self.server = InferenceServer(engine, options)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._grace: float | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="jaxinfer-grpc", daemon=True)

    @property
    def port(self) -> int | None:  # None: no gRPC server
        return self.server.port

    @property
    def http_port(self) -> int | None:
        return self.server.http.port if self.server.http else None

    @property
    def address(self) -> str:
        return self.server.address

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the server did not start in time")
        if self._error is not None:
            raise self._error
        return self

    def stop(self, grace: float | None = None, timeout: float = 60.0) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():  # set together
            self._grace = grace
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout)

    async def _main(self) -> None:
        try:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            await self.server.start()
        except BaseException as e:
            self._error = e
            self._ready.set()
            await asyncio.to_thread(self.server.engine_loop.stop)
            self.server.request_log.close()
            return
        self._ready.set()
        await self._stop.wait()
        await self.server.stop(self._grace)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
