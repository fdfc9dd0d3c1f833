"""Background compilation (EngineConfig.compile_in_background): serve once a first request's buckets are in.

`groups` splits the step's variants (warm_up.step_variants) by token bucket, smallest first, each
bucket with every flavour of it (penalty history, prompt logprobs, the verify step), then one
last group of the decode windows and greedy twins. `serving_order` picks the groups a first
request needs, made ready before the engine starts: the smallest bucket's (its decode steps) and
the bucket a prompt of FIRST_PROMPT_TOKENS fits in (its prefill in one step, where the smaller
buckets alone would take it a few tokens at a time). BackgroundCompile makes the others ready on
a thread of its own, one group after another, ascending, each traced against abstract copies of
the parameters and caches (the steps that run meanwhile donate and replace the real ones).
`ready_buckets` are the buckets whose groups are in: the engine caps its schedulers' token
budget and batch at the largest and pads each step to the smallest ready bucket that holds it,
so a step never needs a variant that is not ready (larger batches wait for their bucket), and
plans decode windows once the last group is in. A group that fails to compile is logged and
ends the thread: the engine keeps serving within the buckets it has.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

Variant = tuple[Any, int, bool]  # (padding inputs, num_steps, greedy), as step_variants lists them
Group = tuple[int | None, list[Variant]]  # (token bucket, its variants); None: windows and twins
FIRST_PROMPT_TOKENS = 64  # a first chat turn's prompt with its template fits in this bucket


def groups(variants: Sequence[Variant]) -> list[Group]:
    """(token bucket, its variants) per bucket in ascending order, then (None, the windows and
    greedy twins)."""
    by_bucket: dict[int, list[Variant]] = {}
    last: list[Variant] = []
    for variant in variants:
        inputs, num_steps, greedy = variant
        if num_steps > 1 or (greedy and inputs.spec is None):  # a window, or a greedy twin
            last.append(variant)
        else:
            by_bucket.setdefault(inputs.token_ids.shape[-1], []).append(variant)
    ordered: list[Group] = [(b, by_bucket[b]) for b in sorted(by_bucket)]
    return ordered + ([(None, last)] if last else [])


def serving_order(ordered: list[Group]) -> tuple[list[Group], list[Group]]:
    """`groups`' list split into (the groups made ready before serving, the rest in order): the
    smallest bucket and the smallest one holding FIRST_PROMPT_TOKENS (else the largest) first."""
    buckets = [bucket for bucket, _ in ordered if bucket is not None]  # a step has one at least
    prompt = next((b for b in buckets if b >= FIRST_PROMPT_TOKENS), buckets[-1])
    first = {buckets[0], prompt}
    return [g for g in ordered if g[0] in first], [g for g in ordered if g[0] not in first]


class BackgroundCompile:
    """Makes `pending` groups ready with `compile_group`, on a daemon thread, in order;
    `ready_buckets` (sorted) and `num_ready` say what is in (the buckets first: the engine's
    thread reads them when num_ready changes)."""

    def __init__(
        self,
        pending: list[Group],
        compile_group: Callable[[list[Variant]], None],
        ready_buckets: Sequence[int],
        num_ready: int,
    ) -> None:
        self.ready_buckets, self.num_ready = tuple(sorted(ready_buckets)), num_ready
        self.total = num_ready + sum(len(group) for _, group in pending)
        self.finished = not pending
        self.error: BaseException | None = None
        self._pending, self._compile = pending, compile_group
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxinfer-compile", daemon=True)
        self._thread.start()

    @property
    def ready_tokens(self) -> int:
        """The largest ready bucket (0: none)."""
        return self.ready_buckets[-1] if self.ready_buckets else 0

    @property
    def complete(self) -> bool:
        """Every variant ready."""
        return self.num_ready == self.total

    def _run(self) -> None:
        try:
            for bucket, group in self._pending:
                if self._stop.is_set():
                    return
                self._compile(group)
                if bucket is not None:
                    self.ready_buckets = tuple(sorted({*self.ready_buckets, bucket}))
                self.num_ready += len(group)
                logger.info(
                    "step variants ready: %d of %d (buckets of %s tokens)",
                    self.num_ready,
                    self.total,
                    ", ".join(map(str, self.ready_buckets)),
                )
        except BaseException as e:  # noqa: BLE001  # serving goes on within the ready buckets
            self.error = e
            logger.error("background compilation stopped at %d of %d variants: %s", self.num_ready, self.total, e)
        finally:
            self.finished = True

    def join(self, timeout: float | None = None) -> bool:
        """Waits for the thread; True once it has finished."""
        self._thread.join(timeout)
        return self.finished

    def stop(self) -> None:
        """No group after the one compiling now."""
        self._stop.set()
