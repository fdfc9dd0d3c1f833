"""HttpServer: the OpenAI-compatible API on uvicorn, inside the event loop of the gRPC server.

    bind():   the listening socket, before anything starts (a taken port fails at once)
    start():  uvicorn.Server(config).serve(sockets=[sock]) as a task of the running loop; uvicorn's
              own signal handlers are left out, so SIGTERM stays the InferenceServer's
    draining: new requests get 503 (health too); admitted ones go on (num_in_flight)
    stop():   uvicorn closes the socket and its idle connections and waits a little for the rest

It serves the EngineLoop, metrics, worker pool, rate limiter (inside Admission) and request log
that InferenceServer owns (one engine, both transports); InferenceServer decides when to drain
and when to stop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import socket
from pathlib import Path
from typing import Any

import uvicorn

from jaxinfer.loader import DEFAULT_MODEL_FILE
from jaxinfer.tokenizer.reasoning import ReasoningParser
from jaxinfer.tokenizer.tool_calls import ToolCallParser
from serving.engine_loop import EngineLoop
from serving.metrics import ServerMetrics
from serving.model_limits import ModelLimits
from serving.openai.admission import Admission
from serving.openai.app import build_app
from serving.openai.auth import APIKeys, key_id
from serving.openai.handlers import ApiContext
from serving.openai.middleware import Gate
from serving.request_log import RequestLog

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


@dataclasses.dataclass
class HttpOptions:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (see HttpServer.port)
    served_model_name: str | None = None  # None: the model path's basename (served_model_name())
    api_keys: tuple[str, ...] = ()  # none: no key needed
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    shutdown_timeout_s: float = 5.0  # what uvicorn waits for open connections once told to stop
    ui: bool = True  # the playground page at /ui
    lora_updates: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter (live LoRA updates)
    kv_events: Any = None  # the KV events publisher (serving.kv_events) /kv_event_sources names


def served_model_name(model_path: object) -> str:
    """`/ckpt/llama-1b` -> `llama-1b`, `x/model.gguf` -> `model`; the embedded default model's name."""
    name = Path(str(model_path).rstrip("/")).name
    if name == DEFAULT_MODEL_FILE:
        return DEFAULT_MODEL_FILE.split(".")[0]  # SmolLM2-135M-Instruct
    return name.removesuffix(".gguf") or str(model_path)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the InferenceServer's signal handlers stay in charge
        yield


class HttpServer:
    def __init__(
        self,
        engine_loop: EngineLoop,
        limits: ModelLimits,
        options: HttpOptions,
        *,
        admission: Admission,
        metrics: ServerMetrics | None = None,
        executor: concurrent.futures.Executor | None = None,
        request_log: RequestLog | None = None,
        tool_parser: ToolCallParser | None = None,
        reasoning: ReasoningParser | None = None,
    ):
        """`tool_parser` / `reasoning`: how chat outputs are read, as the gRPC servicer reads them."""
        engine = engine_loop.engine
        self.options = options
        self.model_name = options.served_model_name or served_model_name(engine.model.path)
        executor = executor or concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="jaxinfer-http")
        ctx = ApiContext(engine_loop, engine.tokenizer, limits, self.model_name, executor, tool_parser, reasoning)
        ctx.lora_updates = options.lora_updates
        keys = APIKeys(list(options.api_keys)) if options.api_keys else None
        self.admission = admission
        self.gate = Gate(
            build_app(ctx, metrics, api_keys=keys is not None, ui=options.ui, kv_events=options.kv_events),
            admission=admission,
            max_body_bytes=options.max_body_bytes,
            keys=keys,
            metrics=metrics,
            request_log=request_log,
        )
        self.port: int | None = None
        self._socket: socket.socket | None = None
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None

    @property
    def address(self) -> str:
        host = self.options.host
        return f"[{host}]:{self.port}" if ":" in host and not host.startswith("[") else f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.options.tls_cert_file else 'http'}://{self.address}"

    @property
    def num_in_flight(self) -> int:
        return self.admission.in_flight

    def bind(self) -> int:
        host = self.options.host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._socket = socket.create_server((host, self.options.port), family=family, backlog=2048)
        except OSError as e:
            raise OSError(f"cannot listen on {host}:{self.options.port} (http): {e.strerror or e}") from None
        self.port = self._socket.getsockname()[1]
        return self.port

    async def start(self) -> None:
        if self._socket is None:
            self.bind()
        if self._socket is None:  # never: bind() listens or raises
            raise OSError(f"the HTTP server on {self.address} has no socket")
        opts = self.options
        config = uvicorn.Config(
            self.gate,
            http="h11",
            ws="none",
            lifespan="off",
            access_log=False,
            log_config=None,
            server_header=False,
            timeout_graceful_shutdown=opts.shutdown_timeout_s,  # type: ignore[arg-type]  # a timeout: float is fine
            ssl_certfile=opts.tls_cert_file,
            ssl_keyfile=opts.tls_key_file,
        )
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what failed
                raise OSError(f"the HTTP server on {self.address} stopped while starting")
            await asyncio.sleep(0.01)
        logger.info(
            "OpenAI-compatible API on %s (model %s, %s)",
            self.url,
            self.model_name,
            f"{len(opts.api_keys)} API keys: " + ", ".join(key_id(k) for k in opts.api_keys)
            if opts.api_keys
            else "no API key",
        )

    def begin_draining(self) -> None:
        self.gate.draining = True

    async def stop(self) -> None:
        if self._task is None or self._server is None:  # both, or neither (start)
            if self._socket is not None:
                self._socket.close()
            return
        self._server.should_exit = True
        try:
            await self._task
        except SystemExit:  # uvicorn exits the process when its start-up failed; not ours to do
            pass
        self._task = None
