"""Admission of generation requests: the one place that decides whether one may start.

    enter(key id)   the in-flight limit the gRPC server has (max_num_seqs + max_waiting), counted
                    over both transports: past it 503 with Retry-After: 1 (OpenAI's "overloaded");
                    then the key's requests per minute and concurrency cap (serving.limits, the
                    RateLimiter the gRPC server shares): past them 429 with Retry-After
    charge_tokens   once the handler knows the prompts and max_tokens: the key's tokens per minute
                    (429), charged for prompt + max_tokens x n
    leave(grant, used tokens)   the slot back; the unused part of the tokens charged refunded

A 429 says which limit (requests per minute / tokens per minute / concurrent requests) and when
to retry; a request that costs more tokens than the per-minute limit can never fit: 429 without
Retry-After and with `x-should-retry: false`, so the official clients do not retry it.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxinfer.sampling import SamplingParams
from serving.limits import Grant, RateLimited, RateLimiter, token_cost
from serving.openai.errors import APIError


class Admission:
    def __init__(
        self, max_in_flight: int, in_flight_elsewhere: Callable[[], int] = lambda: 0, limiter: RateLimiter | None = None
    ):
        self.max_in_flight = max_in_flight
        self.in_flight = 0  # admitted HTTP generation requests not yet answered
        self._elsewhere = in_flight_elsewhere
        self.limiter = limiter or RateLimiter()

    def enter(self, key_id: str | None) -> Grant:
        """Admits one request or raises APIError (503 past the in-flight limit, 429 past a key's)."""
        total = self.in_flight + self._elsewhere()
        if total >= self.max_in_flight:
            raise APIError(
                503,
                f"server busy: {total} requests in flight (limit {self.max_in_flight}); retry later",
                code="server_busy",
                headers={"Retry-After": "1"},
            )
        try:
            grant = self.limiter.admit(key_id)
        except RateLimited as e:
            raise rate_limit_error(e) from None
        self.in_flight += 1
        return grant

    def leave(self, grant: Grant, used_tokens: int | None = None) -> None:
        self.in_flight -= 1
        grant.release(used_tokens)


def charge_tokens(grant: Grant | None, prompts: list[list[int]], params: SamplingParams) -> None:
    """Charges the request's most tokens to its key (APIError 429 past tokens per minute)."""
    if grant is None:
        return
    lengths = [len(p) for p in prompts]
    detail = f"{sum(lengths)} prompt tokens + max_tokens {params.max_tokens} x n {params.n}" + (
        f" x {len(lengths)} prompts" if len(lengths) > 1 else ""
    )
    try:
        grant.charge(token_cost(lengths, params.max_tokens, params.n), detail)
    except RateLimited as e:
        raise rate_limit_error(e) from None


def rate_limit_error(e: RateLimited) -> APIError:
    headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s is not None else {"x-should-retry": "false"}
    return APIError(429, e.message, code="rate_limit_exceeded", headers=headers)
