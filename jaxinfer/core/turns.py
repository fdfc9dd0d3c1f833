"""Turns: which replicas' schedulers plan the next step.

    Turns          every replica plans every step (one replica, or data replicas launched together)
    PipelineTurns  pipeline stages with a batch in flight on each (worker/pipelined.py): the engine
                   keeps S virtual replicas over one KV cache manager; each tick one of them
                   enters a batch, and only a replica whose last batch has left the pipeline may
                   (its sequences' placeholders then stand for the tick just before, the async
                   scheduling the scheduler knows). Among those, the one waiting longest that
                   has work goes first; the others plan nothing this tick. Pages freed wait for
                   the batches in flight (kv/held.py: launches counted, all back when none is left).

A batch that enters at tick k leaves the last stage at tick k + S - 1 (its tokens are that call's
outputs), so with every replica busy they take turns round robin and each stage always has a batch.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxinfer.core.plan import SchedulerPlan
from jaxinfer.core.scheduler import Scheduler
from jaxinfer.kv.held import HeldFreesManager


class Turns:
    """Every replica plans every step."""

    def schedule(self, schedulers: Sequence[Scheduler], num_steps: int) -> tuple[list[SchedulerPlan], list[int]]:
        """The plans of this step and the replica each is of."""
        return [s.schedule(num_steps) for s in schedulers], list(range(len(schedulers)))

    def launched(self, replicas: Sequence[int]) -> None:
        """A step was launched with these replicas' plans."""

    def settle(self, busy: bool) -> None:
        """After a step: `busy` whether a batch is still in the pipeline."""


class PipelineTurns(Turns):
    def __init__(self, num_stages: int, kv_cache: HeldFreesManager):
        """`num_stages` virtual replicas over `kv_cache`, one per stage."""
        self.num_stages, self.kv_cache = num_stages, kv_cache  # the replicas' one manager; it counts the ticks
        self.entered = [-num_stages] * num_stages  # the tick each replica's last batch entered
        self._next = 0  # where the round robin starts

    def ready(self) -> list[int]:
        """The replicas whose last batch has left the pipeline, longest waiting first."""
        n = len(self.entered)
        order = [(self._next + i) % n for i in range(n)]
        return [r for r in order if self.entered[r] <= self.kv_cache.launches - self.num_stages]

    def schedule(self, schedulers: Sequence[Scheduler], num_steps: int) -> tuple[list[SchedulerPlan], list[int]]:
        """One ready replica's plan (one step: windows are not carried), or none (nothing enters).
        A plan without sequences that preempted or moves pages is kept: its work is done at launch."""
        for r in self.ready():
            plan = schedulers[r].schedule(1)
            if plan.seqs or plan.preempted or plan.page_copies or plan.transfers:
                return [plan], [r]
        return [], []

    def launched(self, replicas: Sequence[int]) -> None:
        for r in replicas:
            self.entered[r] = self.kv_cache.launches
            self._next = (r + 1) % len(self.entered)
        self.kv_cache.launched()

    def settle(self, busy: bool) -> None:
        self.kv_cache.settle(busy)
