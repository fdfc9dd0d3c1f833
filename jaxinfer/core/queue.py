"""RequestQueue: the requests a scheduler holds, and the lifecycle of their sequences (plain
Python): queued, running, finished -- abort, finish and preemption cost O(the request's samples)
plus bisect work on the queue, never a scan.

    add_request(id, prompt ids, params)  one Sequence per sample; sample 0 queued, its siblings
                                         held until it has computed the prompt (admission.py)
    finish(seq, status)                  out of the queue or the running list, its pages freed
    abort(id)                            every unfinished sample of the request finished

`waiting` is kept sorted by (priority, arrival, sample index); `running` is in admission order.
The Scheduler (scheduler.py) extends this with the planning of each step.
"""

from __future__ import annotations

import bisect
import itertools
import operator
import random
from collections.abc import Iterable, Iterator

from jaxinfer.core.admission import RequestEntry
from jaxinfer.core.beam import BeamGroup
from jaxinfer.core.sequence import Sequence, SequenceStatus, sample_seed
from jaxinfer.core.stops import StopChecker
from jaxinfer.kv import KVCacheManager
from jaxinfer.lora.slots import AdapterSlots
from jaxinfer.sampling.beam import BeamSearchParams
from jaxinfer.sampling.params import SamplingParams

sort_key = operator.attrgetter("sort_key")  # (priority, arrival, sample index)


class RequestQueue:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        stop_checker: StopChecker | None = None,
        seed: int = 0,
        max_seqs_per_request: int | None = None,
        adapter_slots: AdapterSlots | None = None,
    ):
        for name, value in (
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_num_seqs", max_num_seqs),
            ("max_model_len", max_model_len),
            ("max_seqs_per_request", max_seqs_per_request or 1),
        ):
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        self.kv_cache = kv_cache
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_checker = stop_checker
        self.max_seqs_per_request = max_seqs_per_request  # None: no window
        self.adapter_slots = adapter_slots  # LoRA: the device slots (shared by every replica)
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []  # in admission order (at most max_num_seqs)
        self.requests: dict[str, RequestEntry] = {}  # unfinished requests
        self._num_held = 0  # siblings not yet in the queue
        self._rng = random.Random(seed)  # seeds of unseeded requests
        self.seq_ids: Iterator[int] = itertools.count()  # replicas over one page table share theirs (replica.py)
        self._next_arrival = 0

    # --- requests ---------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        priority: int = 0,
        adapter: str | None = None,
        hash_root: bytes | None = None,
        beam: BeamSearchParams | None = None,
    ) -> list[Sequence]:
        """Queues one Sequence per sample (sampling_params.n) of a request that passed
        core/requests.py's checks (the engine's, once): nothing here checks it again. `adapter`:
        the LoRA adapter it runs under, whose page hashes chain from `hash_root`; `beam`: a beam
        search (one sequence to start with; core/beam.py)."""
        if adapter is not None and self.adapter_slots is None:
            raise ValueError(f"request {request_id!r} asks for LoRA adapter {adapter!r}, but LoRA is not enabled")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival, self._next_arrival = self._next_arrival, self._next_arrival + 1
        base_seed = sampling_params.seed if sampling_params.seed is not None else self._rng.getrandbits(64)
        seqs: list[Sequence] = []
        for i in range(sampling_params.n):
            seq = Sequence(
                self.new_seq_id(),
                request_id,
                prompt_token_ids,
                sampling_params,
                seed=sample_seed(base_seed, i),
                arrival=arrival,
                priority=priority,
                sample_index=i,
                parent=seqs[0] if seqs else None,
                adapter=adapter,
                hash_root=hash_root,
            )
            seqs.append(seq)
        if beam is not None:
            BeamGroup(beam, self.eos_token_ids, seqs[0])
        self.requests[request_id] = entry = RequestEntry.new(seqs)
        self._num_held += len(entry.held)
        self._enqueue(entry, seqs[0])
        return seqs

    def abort(self, request_id: str) -> list[Sequence]:
        """Finishes every unfinished sequence of the request; unknown ids abort nothing."""
        entry = self.requests.get(request_id)
        if entry is None:
            return []
        held = list(entry.held)
        entry.held.clear()
        self._num_held -= len(held)
        for seq in held:  # never queued: nothing to remove, no pages
            seq.status = SequenceStatus.FINISHED_ABORTED
        entry.num_unfinished -= len(held)
        active = [s for s in entry.seqs if not s.is_finished]
        for seq in active:
            self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        if entry.num_unfinished == 0:
            self.requests.pop(request_id, None)
        return held + active

    def finish(self, seq: Sequence, status: SequenceStatus, stop_reason: int | str | None = None) -> None:
        """Ends a queued or running sequence (any finished status) and frees its pages."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)  # at most max_num_seqs long
            self.release_slot(seq)
        else:
            self._dequeue(seq)
        if seq.keep_kv and status is not SequenceStatus.FINISHED_ABORTED:  # for another engine's pull
            seq.kept = self.kv_cache.detach(seq)  # freed once gathered (worker/kv_connector.py)
        else:
            self.kv_cache.free(seq)
        if seq.num_pending:  # tokens of steps in flight past the end: overrun, never emitted
            del seq.token_ids[-seq.num_pending :]
            seq.num_pending = 0
        seq.status, seq.stop_reason = status, stop_reason
        entry = self.requests[seq.request_id]
        entry.num_active -= 1
        entry.num_unfinished -= 1
        if entry.num_unfinished == 0:
            del self.requests[seq.request_id]
        else:
            self._release(entry)

    def acquire_slot(self, seq: Sequence) -> bool:
        """A device slot for the sequence's adapter (none needed without one); False: every
        slot is in use by running sequences of other adapters, so it waits."""
        if seq.adapter is None or self.adapter_slots is None:
            return True
        slot = self.adapter_slots.acquire(seq.adapter)
        seq.lora_slot = slot or 0
        return slot is not None

    def release_slot(self, seq: Sequence) -> None:
        if seq.lora_slot and self.adapter_slots is not None and seq.adapter is not None:
            self.adapter_slots.release(seq.adapter)
        seq.lora_slot = 0

    def new_seq_id(self) -> int:
        return next(self.seq_ids)

    def enqueue_waiting(self, seq: Sequence) -> None:
        """A sequence made while its request runs (a beam's fork) joins the waiting queue."""
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=sort_key)

    def _enqueue(self, entry: RequestEntry, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=sort_key)
        entry.num_active += 1

    def _dequeue(self, seq: Sequence) -> None:
        i = bisect.bisect_left(self.waiting, seq.sort_key, key=sort_key)
        while self.waiting[i] is not seq:  # sort keys are unique per sequence; this is a guard
            i += 1
        del self.waiting[i]

    def _release(self, entry: RequestEntry) -> None:
        """Lets held siblings into the queue as the request's window allows (admission.py)."""
        count = entry.releasable(self.max_seqs_per_request)
        if not count:
            return
        fresh = entry.num_waves > 0  # later waves queue behind the requests that came since
        entry.num_waves += 1
        for _ in range(count):
            seq = entry.held.popleft()
            if fresh:
                seq.arrival, self._next_arrival = self._next_arrival, self._next_arrival + 1
            self._num_held -= 1
            self._enqueue(entry, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._num_held)

    @property
    def num_waiting(self) -> int:
        """Sequences queued or held back (siblings waiting for their parent or their turn)."""
        return len(self.waiting) + self._num_held

    @property
    def num_running(self) -> int:
        return len(self.running)
