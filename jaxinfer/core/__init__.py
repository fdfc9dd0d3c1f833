"""Host-side engine state in plain Python, with no JAX import (a test holds this).

    sequence.py   Sequence: one sample's tokens, pages, status and random stream
    plan.py       SchedulerPlan / ScheduledSeq: what one step computes
    queue.py      RequestQueue: the requests held, their sequences queued, running, finished
    scheduler.py  Scheduler (a RequestQueue): admission, chunked prefill, preemption, stops
    requests.py   every request checked once, before it is queued

The KV pages, reference counts and the prefix cache are jaxinfer.kv's: the scheduler asks its
KVCacheManager for pages and never touches a pool.

Tested on its own with exact page ids; the device side only ever sees the numpy arrays that
`jaxinfer.worker.inputs` builds from a plan.
"""

from jaxinfer.core.plan import ScheduledSeq, SchedulerPlan
from jaxinfer.core.scheduler import Scheduler
from jaxinfer.core.sequence import Sequence, SequenceStatus

__all__ = ["ScheduledSeq", "SchedulerPlan", "Scheduler", "Sequence", "SequenceStatus"]
