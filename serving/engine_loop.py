"""EngineLoop: the one thread that touches the Engine.

    asyncio handlers ──submit/abort/call──► commands (queue.SimpleQueue, thread-safe)
    engine thread:  loop { apply every queued command; if work: outs = engine.step();
                           hand each delta to its request's sink }
    sink(item) = loop.call_soon_threadsafe(asyncio_queue.put_nowait, item)  (set by the handler)

The thread blocks on the command queue only when the engine is idle, so a step never waits for
the event loop and the event loop never waits for a step. A sink receives RequestOutput deltas
and, instead of a final delta, possibly one exception: RequestRejected (the engine refused it:
INVALID_ARGUMENT), ServerShuttingDown, or any other exception (INTERNAL). Failures stay with
their request: a failing add_request or sink only ends that request; a failing step() ends the
requests that were in the engine then, and the loop keeps serving new ones. A handler that finds
several deltas of one request queued (a slow reader) sends them as one: merge_deltas.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from jaxinfer.core.requests import CheckedRequest
from jaxinfer.engine import Engine
from jaxinfer.outputs import RequestOutput

logger = logging.getLogger(__name__)

Sink = Callable[[Any], None]


class RequestRejected(ValueError):
    """The engine refused the request at add_request (a user error)."""


class ServerShuttingDown(RuntimeError):
    """The server stopped before the request finished."""


def merge_deltas(deltas: list[RequestOutput]) -> RequestOutput:
    """Several queued deltas of one request as one (a slow reader gets fewer, larger messages)."""
    if len(deltas) == 1:
        return deltas[0]
    head = dataclasses.replace(
        deltas[0],
        outputs=[
            dataclasses.replace(
                c, token_ids=list(c.token_ids), logprobs=None if c.logprobs is None else list(c.logprobs)
            )
            for c in deltas[0].outputs
        ],
    )
    for delta in deltas[1:]:
        head.merge(delta)
    return head


@dataclasses.dataclass
class _Add:
    request_id: str
    request: CheckedRequest
    sink: Sink
    arrival_time: float


@dataclasses.dataclass
class _Abort:
    request_id: str


@dataclasses.dataclass
class _Call:
    fn: Callable[[Engine], Any]
    future: concurrent.futures.Future


_STOP = object()


class StepMetrics(Protocol):
    """What the loop tells the server's metrics (serving.metrics.ServerMetrics)."""

    def on_tokens(self, count: int, now: float | None = None) -> None: ...
    def on_finished(self, out: RequestOutput) -> None: ...
    def on_step(self, engine: Engine, stats: dict | None = None) -> None: ...


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        metrics: StepMetrics | None = None,
        idle_poll_s: float = 0.5,
        observers: tuple[Callable[[Engine], None], ...] = (),
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.observers = observers  # called on the engine thread after each step (e.g. the KV events publisher)
        self.last_stats: dict = {}  # engine.stats() after the last step (what routers poll as load)
        self.num_steps = 0
        self._idle_poll_s = idle_poll_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="jaxinfer-engine", daemon=True)
        self._stopped = threading.Event()
        self._leftover: list = []  # commands taken from the queue after the stop command

    # --- any thread -----------------------------------------------------------------------------
    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def submit(self, request_id: str, request: CheckedRequest, sink: Sink, arrival_time: float | None = None) -> None:
        """Queues a request the transport checked (serving.model_limits.check_request), which the
        engine does not check again; its outputs (or one exception) go to sink, called on the
        engine thread."""
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self._commands.put(_Add(request_id, request, sink, arrival_time))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def call(self, fn: Callable[[Engine], Any]) -> concurrent.futures.Future:
        """Runs fn(engine) on the engine thread between two steps."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._stopped.is_set():
            future.set_exception(ServerShuttingDown("the engine loop has stopped"))
        else:
            self._commands.put(_Call(fn, future))
        return future

    def stop(self, timeout: float | None = 30.0) -> None:
        """Ends every unfinished request with ServerShuttingDown and joins the thread."""
        self._commands.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_requests(self) -> int:
        """Requests the engine holds now (running or waiting in it): what a router polls as load."""
        return len(self._sinks)  # a dict the engine thread changes; its size read whole under the GIL

    # --- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                if not self._apply(self._take_commands(block=not self.engine.has_unfinished())):
                    break
                if self.engine.has_unfinished():
                    self._step()
                elif self.metrics is not None:
                    self.metrics.on_tokens(0)  # let tokens/s decay while idle
        finally:
            self._stopped.set()
            self._shutdown()

    def _take_commands(self, block: bool) -> list:
        commands = []
        if block:
            try:
                commands.append(self._commands.get(timeout=self._idle_poll_s))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, commands: list) -> bool:
        """Applies commands in arrival order; False once told to stop."""
        for cmd in commands:
            if cmd is _STOP:
                self._leftover = commands[commands.index(cmd) + 1 :]
                return False
            if isinstance(cmd, _Add):
                self._add(cmd)
            elif isinstance(cmd, _Abort):
                if cmd.request_id in self._sinks:
                    del self._sinks[cmd.request_id]
                    self.engine.abort(cmd.request_id)  # frees its pages now
            elif isinstance(cmd, _Call) and cmd.future.set_running_or_notify_cancel():
                try:
                    cmd.future.set_result(cmd.fn(self.engine))
                except Exception as e:
                    cmd.future.set_exception(e)
        return True

    def _add(self, cmd: _Add) -> None:
        try:
            self.engine.add_request(cmd.request, request_id=cmd.request_id, arrival_time=cmd.arrival_time)
        except ValueError as e:
            self._deliver(cmd.request_id, RequestRejected(str(e)), cmd.sink)
            return
        except Exception as e:
            logger.exception("add_request failed for request %s", cmd.request_id)
            self._safe_abort(cmd.request_id)
            self._deliver(cmd.request_id, e, cmd.sink)
            return
        self._sinks[cmd.request_id] = cmd.sink

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine step failed; ending the %d requests in it", len(self._sinks))
            for request_id, sink in list(self._sinks.items()):
                self._safe_abort(request_id)
                self._deliver(request_id, RuntimeError(f"engine step failed: {e}"), sink)
            self._sinks.clear()
            return
        self.num_steps += 1
        now = time.monotonic()
        new_tokens = 0
        for out in outputs:
            new_tokens += sum(len(c.token_ids) for c in out.outputs)
            to = self._sinks.pop(out.request_id, None) if out.finished else self._sinks.get(out.request_id)
            if out.finished and self.metrics is not None:
                self.metrics.on_finished(out)
            if to is not None and not self._deliver(out.request_id, out, to):
                self._sinks.pop(out.request_id, None)
                self._safe_abort(out.request_id)
        self.last_stats = self.engine.stats()  # once a step: the metrics' and what routers poll
        if self.metrics is not None:
            self.metrics.on_tokens(new_tokens, now)
            self.metrics.on_step(self.engine, self.last_stats)
        for observe in self.observers:
            try:
                observe(self.engine)
            except Exception:  # an observer's failure (a socket) costs its own output, never a step
                logger.exception("a step observer failed")

    def _deliver(self, request_id: str, item: RequestOutput | BaseException, sink: Sink) -> bool:
        try:
            sink(item)
            return True
        except Exception:  # e.g. the event loop is closed; only this request is affected
            logger.warning("could not deliver output of request %s; aborting it", request_id, exc_info=True)
            return False

    def _safe_abort(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:
            logger.exception("abort of request %s failed", request_id)

    def _shutdown(self) -> None:
        for request_id, sink in list(self._sinks.items()):
            self._safe_abort(request_id)
            self._deliver(request_id, ServerShuttingDown("the server is shutting down"), sink)
        self._sinks.clear()
        for cmd in self._leftover + self._take_commands(block=False):  # fail whatever is still queued
            if isinstance(cmd, _Add):
                self._deliver(cmd.request_id, ServerShuttingDown("the server is shutting down"), cmd.sink)
            elif isinstance(cmd, _Call) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(ServerShuttingDown("the engine loop has stopped"))
        try:  # the aborted requests' last deltas: collected and dropped, leaving the engine empty
            for _ in range(3):
                if not self.engine.has_unfinished():
                    break
                self.engine.step()
        except Exception:
            logger.exception("could not drain the engine at shutdown")
