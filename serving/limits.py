"""Per-key rate limits, one RateLimiter shared by both transports (gRPC and HTTP).

    grant = limiter.admit(key)          # at admission: 1 request per minute, 1 concurrent slot
    grant.charge(token_cost(...))       # once the prompt is known: prompt + max_tokens x n tokens
    grant.release(used_tokens)          # when it is over: the slot comes back, and the unused
                                        # part of what was charged goes back to the token bucket

Requests and tokens per minute are token buckets: each key's holds at most its per-minute amount
and refills continuously at amount/60 per second, so a key may spend a whole minute's budget in a
burst and then goes on at the steady rate. Tokens are charged for the most a request can use
(prompt + max_tokens x n) and settled when it ends: what it did not generate is refunded. The
concurrency cap counts a key's admitted requests that have not ended.

A refusal is RateLimited, naming the limit and the whole seconds (>= 1) until enough budget is
back (Retry-After). A request that costs more tokens than the bucket holds can never fit:
RateLimited with retry_after_s None. Each check happens before its budget is taken, so a refusal
takes nothing from it (a request refused for its tokens has still spent its request of the minute).

Keys are opaque ids (sha256 prefixes of an API key or of the gRPC token; None is the anonymous
key): the same secret gives the same id on both transports, so they draw on the same buckets.
Both transports run on one event loop, but every operation holds a lock anyway; the clock is
injectable for tests.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable
from typing import NoReturn

RPM, TPM, CONCURRENT = "rpm", "tpm", "concurrent"  # the `limit` label of jaxinfer_rate_limited_total
ANONYMOUS = "anonymous"
_EPS = 1e-6  # a bucket refilled to 0.9999999 of what is asked for has it (float rounding)


@dataclasses.dataclass(frozen=True)
class RateLimits:
    """Per-key limits; None: no such limit."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"RateLimits.{field.name}={value!r}: must be an integer >= 1 or None")

    @property
    def enabled(self) -> bool:
        return any(getattr(self, f.name) is not None for f in dataclasses.fields(self))


class RateLimited(Exception):
    """A request over one of its key's limits; retry_after_s None: it can never fit."""

    def __init__(self, limit: str, message: str, retry_after_s: int | None):
        super().__init__(message)
        self.limit, self.message, self.retry_after_s = limit, message, retry_after_s


def token_cost(prompt_lengths: list[int], max_tokens: int, n: int) -> int:
    """The most tokens a request can use: every prompt plus n samples of max_tokens each."""
    return sum(prompt_lengths) + len(prompt_lengths) * n * max_tokens


def retry_after(seconds: float) -> int:
    """Whole seconds, rounded up, at least 1 (the Retry-After header's unit)."""
    return max(1, math.ceil(seconds - 1e-9))


class TokenBucket:
    """Holds up to `per_minute`, refilled continuously at per_minute / 60 per second."""

    def __init__(self, per_minute: int, now: float):
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self.updated = now

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def seconds_until(self, amount: float) -> float:
        """How long until `amount` is in the bucket (0 when it is there now)."""
        return max(0.0, amount - self.level) / self.rate

    def take(self, amount: float) -> None:
        self.level = max(0.0, self.level - amount)

    def give_back(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)


@dataclasses.dataclass
class _KeyState:
    requests: TokenBucket | None
    tokens: TokenBucket | None
    active: int = 0


class Grant:
    """One admitted request's hold on its key's budgets; release() exactly once when it ends."""

    def __init__(self, limiter: RateLimiter | None, key: str):
        self._limiter, self.key = limiter, key
        self.charged = 0  # tokens taken from the tpm bucket
        self.released = False

    def charge(self, tokens: int, detail: str = "") -> None:
        """Takes `tokens` from the key's tpm bucket or raises RateLimited (nothing taken)."""
        if self._limiter is not None:
            self._limiter._charge(self, tokens, detail)

    def release(self, used_tokens: int | None = None) -> None:
        """Frees the concurrency slot and refunds charged - used tokens (None: refunds nothing)."""
        if self._limiter is not None and not self.released:
            self._limiter._release(self, used_tokens)
        self.released = True


class RateLimiter:
    def __init__(
        self,
        limits: RateLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_limited: Callable[[str], None] | None = None,
    ):
        self.limits = limits or RateLimits()
        self.clock = clock
        self._on_limited = on_limited  # called with RPM / TPM / CONCURRENT for each refusal
        self._keys: dict[str, _KeyState] = {}
        self._lock = threading.Lock()

    def admit(self, key: str | None) -> Grant:
        """A grant for one request of `key`, or RateLimited (rpm or the concurrency cap)."""
        key = key or ANONYMOUS
        if not self.limits.enabled:
            return Grant(None, key)
        with self._lock:
            state = self._state(key)
            rpm, cap = self.limits.requests_per_minute, self.limits.max_concurrent
            if state.requests is not None and state.requests.level < 1 - _EPS:
                wait = retry_after(state.requests.seconds_until(1))
                self._refuse(
                    RPM, f"rate limit of {rpm} requests per minute reached for key {key}; retry in {wait} s", wait
                )
            if cap is not None and state.active >= cap:
                self._refuse(
                    CONCURRENT,
                    f"limit of {cap} concurrent requests reached for key {key}; retry when one of them has finished",
                    1,
                )
            if state.requests is not None:
                state.requests.take(1)
            state.active += 1
        return Grant(self, key)

    def available(self, key: str | None) -> dict[str, float]:
        """What `key` has left now: {"rpm": requests, "tpm": tokens, "concurrent": free slots};
        a limit that is off is absent (for tests and debugging)."""
        with self._lock:
            state = self._state(key or ANONYMOUS)
            left = {RPM: state.requests, TPM: state.tokens}
            out = {name: bucket.level for name, bucket in left.items() if bucket is not None}
            if self.limits.max_concurrent is not None:
                out[CONCURRENT] = self.limits.max_concurrent - state.active
            return out

    def _state(self, key: str) -> _KeyState:
        """The key's buckets, refilled up to now (lock held)."""
        now = self.clock()
        state = self._keys.get(key)
        if state is None:
            rpm, tpm = self.limits.requests_per_minute, self.limits.tokens_per_minute
            state = self._keys[key] = _KeyState(
                None if rpm is None else TokenBucket(rpm, now), None if tpm is None else TokenBucket(tpm, now)
            )
        for bucket in (state.requests, state.tokens):
            if bucket is not None:
                bucket.refill(now)
        return state

    def _refuse(self, limit: str, message: str, retry_after_s: int | None) -> NoReturn:
        if self._on_limited is not None:
            self._on_limited(limit)
        raise RateLimited(limit, message, retry_after_s)

    def _charge(self, grant: Grant, tokens: int, detail: str) -> None:
        tpm = self.limits.tokens_per_minute
        if tpm is None or tokens <= 0:
            return
        with self._lock:
            bucket = self._state(grant.key).tokens
            if bucket is None:  # never: a key's state has a tokens bucket under a tokens limit
                return
            needs = f"this request needs {tokens} tokens{f' ({detail})' if detail else ''}"
            if tokens > bucket.capacity:
                self._refuse(
                    TPM,
                    f"{needs}, more than the limit of {tpm} tokens per minute of key {grant.key}: "
                    "it can never fit; lower max_tokens, n or the prompt",
                    None,
                )
            if bucket.level < tokens - _EPS:
                wait = retry_after(bucket.seconds_until(tokens))
                self._refuse(
                    TPM,
                    f"rate limit of {tpm} tokens per minute reached for key {grant.key}: {needs}, "
                    f"{int(bucket.level)} are left; retry in {wait} s",
                    wait,
                )
            bucket.take(tokens)
            grant.charged += tokens

    def _release(self, grant: Grant, used_tokens: int | None) -> None:
        with self._lock:
            state = self._state(grant.key)
            state.active -= 1
            if state.tokens is not None and used_tokens is not None and grant.charged:
                state.tokens.give_back(grant.charged - min(max(used_tokens, 0), grant.charged))
