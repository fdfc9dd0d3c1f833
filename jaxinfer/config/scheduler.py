"""SchedulerConfig: the step's budget, the context length, per-request limits and the step loop."""

from __future__ import annotations

import dataclasses

from jaxinfer.config.checks import bools, positive_ints
from jaxinfer.options import DISABLE, option

MAX_DECODE_STEPS = 64


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Every step is padded to a token bucket T (CompileConfig) and a sequence bucket
    S = min(T, max_num_seqs). Per-request limits (a request past them is refused with the field
    and the limit named): `max_n` samples, `max_request_tokens` of prompt + max_tokens (default:
    max_model_len), and `max_seqs_per_request` of its samples queued or running at once (the rest
    take turns)."""

    TITLE = "scheduler"

    max_model_len: int | None = option(None, "context length (default: the model's)")
    max_num_seqs: int = option(64, "sequences per step")
    max_num_batched_tokens: int = option(512, "token budget per step")
    max_n: int = option(64, "most samples (n) one request may ask for")
    max_request_tokens: int | None = option(
        None, "most prompt + max_tokens of one request (default: the context length)"
    )
    max_seqs_per_request: int = option(16, "a request's samples queued or running at once; the rest take turns")
    # Plan step N+1 while step N runs; False: the synchronous loop.
    async_scheduling: bool = option(
        True,
        "wait for each step's tokens before planning the next (the synchronous loop)",
        form=DISABLE,
        flag="--no-async-scheduling",
    )
    # Decode windows: when every running sequence decodes, run this many steps per jitted call
    # (sampler inside; the host checks stops afterwards). None: 8 (1 with data replicas).
    num_decode_steps: int | None = option(
        None,
        "decode steps per jitted call when every running sequence decodes (default 8; 1 = a host round trip per token)",
    )
    # The scheduler's random source: the seeds of requests that set none.
    seed: int = option(
        0,
        "seed of the engine's random source, which seeds the requests that set no seed of their own",
        flag="--engine-seed",
    )

    def __post_init__(self):
        positive_ints(
            self,
            "max_model_len",
            "max_num_batched_tokens",
            "max_num_seqs",
            "max_n",
            "max_request_tokens",
            "max_seqs_per_request",
            "num_decode_steps",
        )
        if self.num_decode_steps is not None and self.num_decode_steps > MAX_DECODE_STEPS:
            raise ValueError(
                f"EngineConfig.num_decode_steps must be at most {MAX_DECODE_STEPS}, got {self.num_decode_steps}"
            )
        bools(self, "async_scheduling")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"EngineConfig.seed must be an integer, got {self.seed!r}")
