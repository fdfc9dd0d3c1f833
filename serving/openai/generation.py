"""One HTTP request's engine requests on the shared EngineLoop (the one the gRPC server uses).

    async with EngineRequests(engine_loop, "cmpl-..", inputs) as requests:   # submits one per prompt
        async for prompt_index, delta in requests.deltas(): ...               # merged when queued up
    # leaving the block early (error, client gone, cancelled) aborts what has not finished:
    # EngineLoop.abort frees the pages before the next engine step

Each merged delta is shown to the request's record (request log, tokens-per-minute settling).
The engine thread hands each delta (or one exception instead of the last) to a sink that moves it onto this event loop
(call_soon_threadsafe); nothing here touches the Engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable

from starlette.requests import ClientDisconnect
from starlette.types import Receive

from jaxinfer.outputs import RequestOutput
from serving.engine_loop import EngineLoop, merge_deltas
from serving.openai.errors import from_engine
from serving.openai.inputs import EngineInputs
from serving.request_log import RequestRecord


class EngineRequests:
    def __init__(
        self,
        engine_loop: EngineLoop,
        base_id: str,
        inputs: EngineInputs,
        arrival_time: float | None = None,
        record: RequestRecord | None = None,
    ):
        self._engine_loop, self._inputs, self._record = engine_loop, inputs, record
        self._ids = [f"{base_id}-{i}" for i in range(len(inputs.prompts))]
        self._arrival = time.monotonic() if arrival_time is None else arrival_time
        self._queue: asyncio.Queue = asyncio.Queue()
        self._done: set[int] = set()  # prompts whose engine request is over (finished or failed)

    async def __aenter__(self) -> EngineRequests:
        loop = asyncio.get_running_loop()
        for i, (request_id, request) in enumerate(zip(self._ids, self._inputs.requests)):

            def sink(item, i=i):
                loop.call_soon_threadsafe(self._queue.put_nowait, (i, item))

            self._engine_loop.submit(request_id, request, sink, self._arrival)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for i, request_id in enumerate(self._ids):
            if i not in self._done:
                self._engine_loop.abort(request_id)

    async def deltas(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta) until every prompt has finished; an engine error raises APIError."""
        while len(self._done) < len(self._ids):
            items = [await self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            by_prompt: dict[int, list[RequestOutput]] = {}
            for i, item in items:
                if isinstance(item, BaseException):
                    self._done.add(i)  # the engine loop has let go of it already
                    raise from_engine(item)
                by_prompt.setdefault(i, []).append(item)
            for i, deltas in by_prompt.items():
                merged = merge_deltas(deltas)
                if self._record is not None:
                    self._record.observe(i, merged)
                if merged.finished:
                    self._done.add(i)
                yield i, merged

    async def collect(self) -> list[RequestOutput]:
        """Every prompt's whole output, in prompt order."""
        results: dict[int, RequestOutput] = {}
        async for i, delta in self.deltas():
            if i in results:
                results[i].merge(delta)
            else:
                results[i] = delta
        return [results[i] for i in range(len(self._ids))]


async def unless_disconnected[T](receive: Receive, work: Awaitable[T]) -> T:
    """Awaits `work` unless the client goes away first: then cancels it (its cleanup aborts the
    engine requests) and raises ClientDisconnect. For responses that are not streamed, whose
    handler would otherwise notice only when it writes the answer."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():  # the client went first
        raise ClientDisconnect()
    return task.result()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
