"""Admission of generation requests: the one place that decides whether one may start.

Today: the in-flight limit the gRPC server has (max_num_seqs + max_waiting), counted over both
transports, so HTTP and gRPC together never queue more than one server's worth; past it a 503
with Retry-After (OpenAI's "overloaded" answer). Every request passes here with its API key id,
which is where per-key rate limits (429) slot in.
"""
from __future__ import annotations

from typing import Callable

from serving.openai.errors import APIError


class Admission:
    def __init__(self, max_in_flight: int, in_flight_elsewhere: Callable[[], int] = lambda: 0):
        self.max_in_flight = max_in_flight
        self.in_flight = 0  # admitted HTTP generation requests not yet answered
        self._elsewhere = in_flight_elsewhere

    def enter(self, key_id: str | None) -> None:
        """Admits one request or raises APIError (503 past the limit)."""
        total = self.in_flight + self._elsewhere()
        if total >= self.max_in_flight:
            raise APIError(503, f"server busy: {total} requests in flight (limit {self.max_in_flight}); "
                                "retry later", code="server_busy", headers={"Retry-After": "1"})
        self.in_flight += 1

    def leave(self, key_id: str | None) -> None:
        self.in_flight -= 1
