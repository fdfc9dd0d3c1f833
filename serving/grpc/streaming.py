"""One Generate call's stream between the engine thread and the servicer, and how it ends.

    engine thread ──call_soon_threadsafe──► the call's asyncio.Queue: deltas, or an exception
    next_items: waits for the next item (bounded by call_deadline(): DEADLINE_EXCEEDED), then takes
                whatever else queued up while the client was slow -> (deltas, error or None)
    status_of:  an engine loop error -> Refused (INVALID_ARGUMENT, UNAVAILABLE, INTERNAL)
    charge:     the key's tokens per minute, once the prompt is known (RESOURCE_EXHAUSTED)

Refused carries a status, its details and trailing metadata (`retry-after`) up to the servicer,
which aborts the call with them.
"""

from __future__ import annotations

import asyncio

import grpc

from jaxinfer.outputs import RequestOutput
from jaxinfer.sampling import SamplingParams
from serving.engine_loop import RequestRejected, ServerShuttingDown
from serving.limits import Grant, RateLimited, token_cost


class Refused(Exception):
    """The call ends with this status (the servicer aborts it, counted by the metrics)."""

    def __init__(self, code: grpc.StatusCode, details: str, metadata: tuple = ()):
        super().__init__(details)
        self.code, self.details, self.metadata = code, details, metadata


async def next_items(
    queue: asyncio.Queue, deadline: float | None, loop: asyncio.AbstractEventLoop
) -> tuple[list[RequestOutput], BaseException | None]:
    """Waits for the next item, then takes whatever else is queued: (deltas, error or None)."""
    if deadline is None:
        items = [await queue.get()]
    else:
        try:
            async with asyncio.timeout_at(deadline):
                items = [await queue.get()]
        except TimeoutError:
            raise Refused(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded before the request finished") from None
    while not queue.empty():
        items.append(queue.get_nowait())
    deltas: list[RequestOutput] = []
    for item in items:
        if isinstance(item, BaseException):
            return deltas, item
        deltas.append(item)
    return deltas, None


def call_deadline(context: grpc.aio.ServicerContext, loop: asyncio.AbstractEventLoop) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else loop.time() + max(0.0, remaining)


def charge(grant: Grant, num_prompt_tokens: int, params: SamplingParams) -> None:
    """The key's tokens per minute: the prompt + max_tokens x n (RESOURCE_EXHAUSTED past them)."""
    try:
        grant.charge(
            token_cost([num_prompt_tokens], params.max_tokens, params.n),
            f"{num_prompt_tokens} prompt tokens + max_tokens {params.max_tokens} x n {params.n}",
        )
    except RateLimited as e:
        raise rate_limited(e) from None


def rate_limited(e: RateLimited) -> Refused:
    metadata = (("retry-after", str(e.retry_after_s)),) if e.retry_after_s is not None else ()
    return Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, e.message, metadata)


def status_of(error: BaseException) -> Refused:
    if isinstance(error, RequestRejected):
        return Refused(grpc.StatusCode.INVALID_ARGUMENT, str(error))
    if isinstance(error, ServerShuttingDown):
        return Refused(grpc.StatusCode.UNAVAILABLE, str(error))
    return Refused(grpc.StatusCode.INTERNAL, f"request failed: {error}")
