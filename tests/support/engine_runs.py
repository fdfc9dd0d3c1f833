"""Running an Engine's requests to the end, for the tests that drive the engine step by step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def run_requests(engine: Any, requests: Sequence[tuple], watch: Callable[[Any], None] | None = None) -> list:
    """(prompt, params) per request, or (prompt, params, {add_request's keyword arguments}), all
    queued at once (ids "0", "1", ...): the final, merged RequestOutput of each, in order.
    `watch(engine)` runs after every step."""
    for i, (prompt, params, *more) in enumerate(requests):
        engine.add_request(prompt, params, request_id=str(i), **(more[0] if more else {}))
    final: dict = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id in final:
                final[out.request_id].merge(out)
            else:
                final[out.request_id] = out
        if watch is not None:
            watch(engine)
    assert all(out.finished for out in final.values())
    return [final[str(i)] for i in range(len(requests))]
