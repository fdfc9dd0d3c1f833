"""Sequence: the host-side state of one generated sample (plain Python, no JAX).

A request with `n` samples becomes `n` Sequences sharing a request id; `sample_index` tells them
apart. A sequence's tokens are its prompt followed by its outputs. `num_computed_tokens` counts
the leading tokens whose KV is in the cache; each step computes some more, and a step that reaches
the end of the known tokens samples one new token. After a preemption `num_computed_tokens` drops
to 0 and the sequence recomputes prompt and outputs (much of it from the prefix cache).

Parallel samples (n > 1): sample 0 is the parent. Its siblings wait until it has computed its
prompt (it has sampled a token or finished; core/admission.py holds them back); by then every
full page of the prompt is in the prefix cache, so each sibling takes those pages by reference
and recomputes only the partial last page of the prompt (fewer than page_size + 1 tokens) into
pages of its own. That costs a little compute per sibling but needs no copy-on-write of partial
pages.

Random streams: every sequence has a 64-bit `seed`. With `SamplingParams.seed` set, sample 0 uses
that seed and sample i > 0 a seed derived from (seed, i), so a seeded request is reproducible; an
unseeded one gets a seed from the scheduler's generator. The sampler folds the number of tokens
generated so far into the key, so a sample never depends on what else is in the batch, nor on
whether the sequence was preempted and recomputed.
"""

from __future__ import annotations

import enum
import hashlib
from typing import Any, Protocol

from jaxinfer.sampling.params import SamplingParams

SEED_MASK = (1 << 64) - 1
PLACEHOLDER = -1  # a token sampled by a step still in flight (async scheduling), not yet known


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, will recompute
    FINISHED_STOPPED = "stop"  # eos, a stop token id, or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """ "stop" | "length" | "abort" for finished sequences, else None."""
        return self.value if self.is_finished else None


_FINISHED = {SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED}


class GrammarMatcher(Protocol):
    """What the host side reads of a sequence's grammar matcher (a jaxinfer.structured RowMatcher
    or ReasoningGate; core imports none of structured): it advances past each sampled token."""

    def consume(self, token: int) -> bool: ...
    @property
    def error(self) -> str | None: ...


def sample_seed(seed: int, sample_index: int) -> int:
    """The 64-bit seed of sample `sample_index` of a request seeded with `seed`."""
    if sample_index == 0:
        return seed & SEED_MASK
    digest = hashlib.sha256(f"{seed}:{sample_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


class Sequence:
    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        seed: int,
        arrival: int,
        priority: int = 0,
        sample_index: int = 0,
        parent: Sequence | None = None,
        adapter: str | None = None,
        hash_root: bytes | None = None,
    ):
        self.seq_id = seq_id
        self.request_id = request_id
        self.sample_index = sample_index
        self.parent = parent  # sample 0 of the request, for siblings (n > 1)
        self.sampling_params = sampling_params
        self.seed = seed & SEED_MASK
        self.priority = priority  # lower number = served first
        self.arrival = arrival  # admission order, a tie breaker after priority
        self.status = SequenceStatus.WAITING
        self.stop_reason: int | str | None = None  # the stop token id or stop string, if any
        self.num_preemptions = 0

        self.token_ids: list[int] = list(prompt_token_ids)  # prompt, then outputs
        self.num_pending = 0  # trailing PLACEHOLDERs: tokens of steps in flight
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_scored_prompt = 0  # prompt positions whose logprobs landed (prompt_logprobs)
        # KV pages: written by the KV cache manager (jaxinfer.kv) alone, read by plans.
        self.pages: list[int] = []  # block table: page i holds tokens [i*ps, (i+1)*ps)
        self.group_pages: list[list[int]] = []  # the block tables of layer groups 1 .. G-1, if any
        self.page_hashes: list = []  # chained hashes of the full pages of token_ids
        self.num_cached_pages = 0  # leading pages registered in the prefix cache
        self.num_host_hit_tokens = 0  # of its last admission's prefix hit, tokens from the host tier
        self.swap: Any = None  # a kv.swap.SwappedKV: its pages in the host tier while preempted
        # Disaggregated prefill/decode (worker/disagg.py): keep its pages for another engine's pull
        # when it finishes (`kept`: its tables, handed over), or wait while its prompt's pages are
        # pulled from one (`pulling`), held until admission (`received`: a kv.prefix.ReceivedKV).
        self.keep_kv, self.pulling, self.received = False, False, None
        self.kept: list[list[int]] | None = None
        # LoRA: the adapter it runs under (None: the base model), what its page hashes chain from
        # (the adapter's own root: no page is shared across adapters), and its device slot while
        # it runs (0: none; the scheduler acquires and releases it, jaxinfer/lora/slots.py).
        self.adapter, self.hash_root, self.lora_slot = adapter, hash_root, 0
        # Structured output: a jaxinfer.structured.RowMatcher the engine attaches (None: free).
        self.grammar: GrammarMatcher | None = None
        # Speculative decoding: the drafts proposed for the next step (set before each schedule),
        # and how many were drafted / accepted over how many verify steps (metrics).
        self.draft_token_ids: list[int] = []
        self.num_draft_tokens = self.num_accepted_tokens = self.num_verify_steps = 0
        # Beam search (core/beam.py): its group, its summed logprob, and the candidates of its
        # last step while it waits for the group's decision (None: none landed).
        self.beam: Any = None  # a core.beam.BeamGroup (which imports this module)
        self.beam_score = 0.0
        self.beam_candidates: list[tuple[int, float]] | None = None

    @property
    def sort_key(self) -> tuple[int, int, int]:
        """Scheduling order: priority, then arrival, then sample index. Preemption takes the max."""
        return (self.priority, self.arrival, self.sample_index)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are known (all but the placeholders of steps in flight)."""
        return len(self.token_ids) - self.num_pending

    @property
    def known_output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens : self.num_known_tokens]

    @property
    def last_token_id(self) -> int:
        """The newest known token (placeholders of steps in flight aside)."""
        return self.token_ids[self.num_known_tokens - 1]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def cacheable_pages(self, page_size: int) -> int | None:
        """How many leading prefix-cached pages the sequence may take: all (None) but while its
        prompt logprobs are being scored, when every position not scored yet is computed."""
        if (
            self.sampling_params.prompt_logprobs is None
            or self.sample_index != 0
            or self.num_scored_prompt >= self.num_prompt_tokens - 1
        ):
            return None
        return self.num_scored_prompt // page_size

    def page_tables(self) -> tuple[tuple[int, ...], ...]:
        """A copy of its block table of each layer group (group 0's first)."""
        return (tuple(self.pages), *map(tuple, self.group_pages))

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, request={self.request_id!r}#{self.sample_index}, "
            f"{self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, "
            f"pages={self.pages})"
        )
