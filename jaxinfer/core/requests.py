"""Requests checked once: what a request must satisfy to ever run, for every way in.

    limits = engine.limits                        # the engine's context, KV capacity, compiled features
    checked = check_request(ids, params, limits)  # a CheckedRequest, or a RequestError naming the field
    engine.add_request(checked)                   # queued as it is: nothing is checked twice

The Python API checks in Engine.add_request / Engine.check_request (after tokenizing, with the
grammar compiled); both servers run the same checks on a worker thread (serving/model_limits.py)
and hand the engine loop the CheckedRequest, so the engine thread never checks a request and the
scheduler trusts what it is given.

Lengths: prompt + max_tokens must fit max_model_len (generated tokens are part of the context),
and max_request_tokens where the engine sets one. max_tokens=0 scores the prompt and generates
nothing, so such a prompt may fill the whole context. The last sampled token is never fed back,
so a sequence holds KV for at most max(prompt, prompt + max_tokens - 1) tokens, which must fit
the KV pool of one replica.

A RequestError's message starts with what is wrong -- a SamplingParams field
("SamplingParams.n=17: ...") or the prompt ("prompt of 600 tokens ...") -- and `field` names it,
so a transport can name its own request field instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxinfer.kv import group_for
from jaxinfer.lora.request import LoRARequest
from jaxinfer.sampling.beam import BeamSearchParams
from jaxinfer.sampling.params import SamplingParams, check_logit_bias_vocab


class RequestError(ValueError):
    """A request that can never run; `field` is the SamplingParams field (or "prompt",
    "priority") at fault, and the message starts with it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What an engine can run: its vocabulary and context, its per-request limits, the features
    it compiled, and its KV pool (None: not checked). `owner` names it in messages ("this
    engine's max_n", "this server's")."""

    vocab_size: int
    max_model_len: int
    max_request_tokens: int | None = None
    max_n: int = 64
    penalties: bool = True
    prompt_logprobs: bool = False
    page_size: int | None = None
    num_usable_pages: int | None = None
    owner: str = "engine"
    max_num_seqs: int | None = None  # a beam search's width must fit the running batch
    num_eos: int = 0  # end-of-sequence ids (a beam search keeps more candidates per eos)
    no_beam_search: str | None = None  # why this engine runs no beam search (None: it does)
    # the KV pool's layer groups (their sliding windows; None: full attention) and the most
    # tokens one step computes of a sequence: the pages a request holds at most
    kv_windows: tuple[int | None, ...] = (None,)
    max_chunk: int = 1
    kv_role: str = "both"  # disaggregated prefill/decode: which side this engine takes (or both)

    def pages_held(self, num_tokens: int) -> int:
        """The most KV pages a sequence of `num_tokens` tokens holds over the layer groups."""
        assert self.page_size is not None
        return sum(group_for(w).max_pages_held(num_tokens, self.max_chunk, self.page_size) for w in self.kv_windows)

    def option(self, flag: str, kwarg: str) -> str:
        """How the owner's user turns a feature on: a server's flag; an engine's option or flag."""
        return flag if self.owner == "server" else f"{kwarg} or {flag}"


def context_length(max_model_len: int | None, model_len: int) -> int:
    """The engine's context: EngineConfig.max_model_len where given (at most the model's), else
    the model's max_position_embeddings."""
    if max_model_len is not None and max_model_len > model_len:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's context of {model_len} tokens")
    return max_model_len or model_len


@dataclasses.dataclass(frozen=True)
class CheckedRequest:
    """A request that passed `check_request`: the engine queues it without checking again."""

    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None  # the prompt's text, where it came as text
    priority: int = 0
    lora: LoRARequest | None = None  # the LoRA adapter it runs under (None: the base model)
    beam: BeamSearchParams | None = None  # a beam search (params: how each beam's step samples)
    kv_transfer: Any = None  # a kv_transfer_params.KVTransferRequest: disaggregated prefill/decode


def check_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams | BeamSearchParams,
    limits: RequestLimits,
    *,
    prompt: str | None = None,
    priority: int = 0,
    kv_transfer: Any = None,
) -> CheckedRequest:
    """Every check a request must pass before it is queued (RequestError naming the field); a
    beam search (BeamSearchParams) is checked as the SamplingParams each beam's step samples with."""
    beam = params if isinstance(params, BeamSearchParams) else None
    if beam is not None:
        params = check_beam(beam, limits)
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams or BeamSearchParams, got {type(params).__name__}")
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise RequestError("priority", f"priority={priority!r} must be an int")
    check_params(params, limits)
    ids = check_prompt_ids(prompt_token_ids, limits.vocab_size)
    check_lengths(len(ids), params, limits)
    if kv_transfer is not None:
        check_kv_transfer(kv_transfer, params, beam, limits)
    return CheckedRequest(ids, params, prompt, priority, beam=beam, kv_transfer=kv_transfer)


def check_kv_transfer(kv: Any, params: SamplingParams, beam: BeamSearchParams | None, limits: RequestLimits) -> None:
    """A disaggregated prefill/decode request this engine's role takes."""
    wanted = {"produce": ("prefill", "do_remote_decode"), "consume": ("decode", "do_remote_prefill")}[kv.kind]
    if limits.kv_role not in ("both", wanted[0]):
        raise RequestError(
            "kv_transfer_params",
            f"kv_transfer_params.{wanted[1]}=true: this {limits.owner}'s kv_role is {limits.kv_role}, not {wanted[0]}",
        )
    if beam is not None or params.prompt_logprobs is not None:
        raise RequestError("kv_transfer_params", "kv_transfer_params: not with beam search or prompt_logprobs")


def check_beam(beam: BeamSearchParams, limits: RequestLimits) -> SamplingParams:
    """A beam search this engine can run: the SamplingParams of its beams' steps."""
    if limits.no_beam_search is not None:
        why = limits.no_beam_search
        raise RequestError("beam_width", f"beam search is not available on this {limits.owner}: {why}")
    width = beam.beam_width
    for most, what in ((limits.max_n, "max_n"), (limits.max_num_seqs, "max_num_seqs")):
        if most is not None and width > most:
            why = f"exceeds this {limits.owner}'s {what}={most}"
            raise RequestError("beam_width", f"BeamSearchParams.beam_width={width}: {why}")
    try:
        return beam.step_params(limits.num_eos)
    except ValueError as e:
        raise RequestError("beam_width", str(e)) from None


def check_params(params: SamplingParams, limits: RequestLimits) -> None:
    """What of `params` the engine was not started for, or its vocabulary does not hold."""
    owner = limits.owner
    if params.n > limits.max_n:
        raise RequestError("n", f"SamplingParams.n={params.n}: exceeds this {owner}'s max_n={limits.max_n}")
    if params.uses_penalties and not limits.penalties:
        raise RequestError(
            "repetition_penalty",
            "SamplingParams.repetition_penalty/presence_penalty/"
            f"frequency_penalty: penalties are off on this {owner} (started with "
            f"{limits.option('--no-penalties', 'penalties=False')})",
        )
    if params.prompt_logprobs is not None and not limits.prompt_logprobs:
        raise RequestError(
            "prompt_logprobs",
            f"SamplingParams.prompt_logprobs={params.prompt_logprobs}: prompt "
            f"logprobs are off on this {owner} (start it with "
            f"{limits.option('--enable-prompt-logprobs', 'enable_prompt_logprobs=True')})",
        )
    try:
        check_logit_bias_vocab(params, limits.vocab_size)
    except ValueError as e:  # "SamplingParams.logit_bias[50257]: token ids out of the vocabulary ..."
        raise RequestError("logit_bias", str(e)) from None


def check_prompt_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    """The prompt's token ids as a list: not empty, each an int in [0, vocab_size)."""
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)  # numpy arrays too
    if not ids:
        raise RequestError("prompt", "prompt is empty")
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise RequestError("prompt", f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    return ids


def check_lengths(num_prompt_tokens: int, params: SamplingParams, limits: RequestLimits) -> None:
    """The prompt and max_tokens against the context, max_request_tokens and the KV pool."""
    p, m, context = num_prompt_tokens, params.max_tokens, limits.max_model_len
    total = p + m
    if p > context:
        raise RequestError("prompt", f"prompt of {p} tokens does not fit the context of {context} tokens")
    if p == context and m > 0:
        raise RequestError(
            "prompt",
            f"prompt of {p} tokens fills the context of {context} tokens, leaving no room "
            f"for max_tokens={m} (only max_tokens=0, which scores the prompt, may fill it)",
        )
    cap = limits.max_request_tokens
    if cap is not None and total > cap:
        raise RequestError(
            "max_tokens",
            f"SamplingParams.max_tokens={m}: exceeds this {limits.owner}'s "
            f"max_request_tokens={cap} with the prompt's {p} tokens ({total} in all)",
        )
    if total > context:
        raise RequestError(
            "max_tokens", f"prompt of {p} tokens + max_tokens={m} = {total} tokens exceeds max_model_len={context}"
        )
    if limits.num_usable_pages is not None and limits.page_size is not None:
        pages = limits.pages_held(max(p, total - 1))
        if pages > limits.num_usable_pages:
            raise RequestError(
                "max_tokens",
                f"prompt of {p} tokens + max_tokens={m} needs {pages} KV pages of "
                f"{limits.page_size} tokens, but the pool has only {limits.num_usable_pages}",
            )
