"""Background compilation (EngineConfig.compile_in_background): serve once the smallest bucket is in.

`groups` splits the step's variants (warm_up.step_variants) by token bucket, smallest first, each
bucket with every flavour of it (penalty history, prompt logprobs, the verify step), then one
last group of the decode windows and greedy twins. The compiled step makes the first group
ready before the engine starts; BackgroundCompile makes the others ready on a thread of its own,
one group after another, each traced against abstract copies of the parameters and caches (the
steps that run meanwhile donate and replace the real ones). `ready_tokens` is the largest
bucket whose group is in: the engine caps its schedulers' token budget and batch at it, so a
step never needs a variant that is not ready (larger batches wait for their bucket), and
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


def groups(variants: Sequence[Variant]) -> list[tuple[int | None, list[Variant]]]:
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
    ordered: list[tuple[int | None, list[Variant]]] = [(b, by_bucket[b]) for b in sorted(by_bucket)]
    return ordered + ([(None, last)] if last else [])


class BackgroundCompile:
    """Makes `pending` groups ready with `compile_group`, on a daemon thread, in order."""

    def __init__(
        self,
        pending: list[tuple[int | None, list[Variant]]],
        compile_group: Callable[[list[Variant]], None],
        ready_tokens: int,
        num_ready: int,
    ) -> None:
        self.ready_tokens, self.num_ready = ready_tokens, num_ready
        self.total = num_ready + sum(len(group) for _, group in pending)
        self.finished = not pending
        self.error: BaseException | None = None
        self._pending, self._compile = pending, compile_group
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxinfer-compile", daemon=True)
        self._thread.start()

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
                self.num_ready += len(group)
                if bucket is not None:
                    self.ready_tokens = bucket
                logger.info(
                    "step variants ready: %d of %d (buckets up to %d tokens)",
                    self.num_ready,
                    self.total,
                    self.ready_tokens,
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
