"""Admission of a request's samples: siblings wait for their parent, then enter in a window.

A request with n samples is one RequestEntry. Sample 0 (the parent) enters the waiting queue at
once; its siblings are held outside the queue until the parent has computed the prompt they will
share (it has sampled a token, or finished). Then they enter the queue, but at most `window` of
the request's sequences are ever queued or running at once; each one that finishes lets the next
held sibling in. The first wave keeps the request's place in line (arrival); later waves go to the
back of the line with a fresh arrival, so a request with a large n takes turns with the requests
that came after it instead of holding the queue until all its samples are done.

Everything here is O(1) per sequence: the scheduler's queue holds at most `window` sequences of
any one request, and a request's unfinished count is a counter, not a scan of its samples.
"""

from __future__ import annotations

import collections
import dataclasses

from jaxinfer.core.sequence import Sequence


@dataclasses.dataclass
class RequestEntry:
    seqs: list[Sequence]  # every sample, by sample index
    held: collections.deque[Sequence]  # siblings not yet in the waiting queue
    num_unfinished: int
    num_active: int = 0  # in the waiting queue or running
    num_waves: int = 0  # how many times held siblings were let in

    @classmethod
    def new(cls, seqs: list[Sequence]) -> RequestEntry:
        return cls(seqs, collections.deque(seqs[1:]), num_unfinished=len(seqs))

    @property
    def parent_ready(self) -> bool:
        """The parent computed the prompt: its full pages are in the prefix cache to share."""
        parent = self.seqs[0]
        return parent.is_finished or parent.num_output_tokens > 0

    def releasable(self, window: int | None) -> int:
        """How many held siblings may enter the queue now."""
        if not self.held or not self.parent_ready:
            return 0
        room = len(self.held) if window is None else window - self.num_active
        return max(0, min(room, len(self.held)))
