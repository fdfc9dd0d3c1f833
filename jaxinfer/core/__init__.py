"""Host-side engine state in plain Python, with no JAX import (a test holds this).

    sequence.py   Sequence: one sample's tokens, pages, status and random stream
    paging.py     PagePool: the KV pages, reference counts and the prefix cache
    plan.py       SchedulerPlan / ScheduledSeq: what one step computes
    scheduler.py  Scheduler: admission, chunked prefill, preemption, stops

Tested on its own with exact page ids; the device side only ever sees the numpy arrays that
`jaxinfer.worker.inputs` builds from a plan.
"""
from jaxinfer.core.paging import NULL_PAGE, OutOfPagesError, PagePool
from jaxinfer.core.plan import ScheduledSeq, SchedulerPlan
from jaxinfer.core.scheduler import Scheduler
from jaxinfer.core.sequence import Sequence, SequenceStatus

__all__ = ["NULL_PAGE", "OutOfPagesError", "PagePool", "ScheduledSeq", "SchedulerPlan", "Scheduler",
           "Sequence", "SequenceStatus"]
