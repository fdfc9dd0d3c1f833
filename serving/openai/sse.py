"""Server-sent events as OpenAI streams them: `data: <json>\\n\\n` per chunk, `data: [DONE]\\n\\n` last.

SSEResponse streams an async iterator of such events and, at the same time, listens for the
client going away: then it cancels the iterator (whose `finally` aborts the engine requests)
instead of noticing only at the next write, which may be many engine steps later.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering either


def event(payload: dict) -> bytes:
    """One SSE event. JSON has no raw newlines, so the payload fits one `data:` line."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None]) -> None:
        super().__init__(events, headers=HEADERS)
        self._events = events  # the body iterator itself, which it closes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:

            async def stream() -> None:
                try:
                    await self.stream_response(send)
                finally:
                    group.cancel_scope.cancel()

            group.start_soon(stream)
            await self.listen_for_disconnect(receive)  # returns when the client is gone (or done)
            group.cancel_scope.cancel()
        await self._events.aclose()  # runs the iterator's `finally` even if it never started
