"""EngineFeeder: one engine, many callers, a thread that keeps its batch full.

A Ray actor receives several batches of rows at once (one coroutine each); each row's request is
queued with a future, and one thread adds whatever is queued to the engine and steps it while any
request is in flight, so requests from every batch share each step (continuous batching across
Ray's blocks, not one `generate` per block). A request's future gets its whole RequestOutput when
it finishes, or the error that refused it; a failing step fails the requests then in flight.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxinfer.engine import Engine
    from jaxinfer.lora.request import LoRARequest
    from jaxinfer.outputs import RequestOutput
    from jaxinfer.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

_Item = tuple[str | list[int], "SamplingParams", "LoRARequest | None", concurrent.futures.Future]


class EngineFeeder:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._pending: dict[str, tuple[concurrent.futures.Future, RequestOutput | None]] = {}
        self._thread = threading.Thread(target=self._run, name="jaxinfer-feeder", daemon=True)
        self._thread.start()

    def submit(
        self, prompt: str | list[int], params: SamplingParams, lora: LoRARequest | None = None
    ) -> concurrent.futures.Future[RequestOutput]:
        future: concurrent.futures.Future[RequestOutput] = concurrent.futures.Future()
        self._queue.put((prompt, params, lora, future))
        return future

    @property
    def num_in_flight(self) -> int:
        return len(self._pending)

    def close(self, timeout: float | None = 30.0) -> None:
        """Ends the thread; requests still in flight are aborted and get a RuntimeError."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            items = [] if self._pending else [self._queue.get()]  # idle: wait for work
            while True:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            for item in items:
                if item is None:
                    self._abort_all(RuntimeError("the engine feeder was closed"))
                    while self.engine.has_unfinished():  # the aborts land (and a step in flight)
                        self.engine.step()
                    return
                self._add(*item)
            if self._pending:
                self._step()

    def _add(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        lora: LoRARequest | None,
        future: concurrent.futures.Future,
    ) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            rid = self.engine.add_request(prompt, params, lora_request=lora)
        except Exception as e:  # noqa: BLE001 - a refused request is that request's error
            future.set_exception(e)
            return
        self._pending[rid] = (future, None)

    def _step(self) -> None:
        try:
            deltas = self.engine.step()
        except Exception as e:  # noqa: BLE001 - the requests in flight fail; the thread goes on
            logger.exception("engine step failed; failing %d requests in flight", len(self._pending))
            self._abort_all(e)
            return
        for delta in deltas:
            entry = self._pending.get(delta.request_id)
            if entry is None:
                continue
            future, acc = entry
            if acc is None:
                acc = delta
            else:
                acc.merge(delta)
            if acc.finished:
                del self._pending[delta.request_id]
                future.set_result(acc)
            else:
                self._pending[delta.request_id] = (future, acc)

    def _abort_all(self, error: BaseException) -> None:
        """Every request in flight aborted in the engine and failed with `error`."""
        for rid, (future, _) in self._pending.items():
            self.engine.abort(rid)
            future.set_exception(error)
        self._pending.clear()
