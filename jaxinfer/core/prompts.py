"""A request's prompt: text or token ids in, token ids out, with errors that name the problem."""
from __future__ import annotations

from jaxinfer.sampling.params import SamplingParams


def tokenize_prompt(prompt: object, tokenizer, vocab_size: int) -> tuple[str | None, list[int]]:
    """(the prompt text or None, its token ids). ValueError for an empty prompt, a wrong type,
    text without a tokenizer, or ids outside [0, vocab_size)."""
    if not isinstance(prompt, (str, list, tuple)) and not hasattr(prompt, "tolist"):
        raise ValueError(f"prompt={prompt!r:.60}: must be a string or a list of token ids")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        if tokenizer is None:
            raise ValueError("this engine has no tokenizer: pass prompt token ids")
        return prompt, tokenizer.encode(prompt)
    ids = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)  # numpy arrays too
    if not isinstance(ids, list):
        raise ValueError(f"prompt={prompt!r:.60}: must be a string or a list of token ids")
    if not ids:
        raise ValueError("prompt token ids are empty")
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    return None, ids


def check_prompt_length(num_prompt_tokens: int, params: SamplingParams, *, max_model_len: int,
                        max_request_tokens: int | None) -> None:
    """ValueError when the prompt leaves no room in the context, or prompt + max_tokens passes
    the engine's per-request limit."""
    if num_prompt_tokens >= max_model_len:
        raise ValueError(f"prompt of {num_prompt_tokens} tokens does not fit the context of "
                         f"{max_model_len} tokens (it must leave room for at least one generated token)")
    if max_request_tokens is not None and num_prompt_tokens + params.max_tokens > max_request_tokens:
        raise ValueError(f"prompt of {num_prompt_tokens} tokens + SamplingParams.max_tokens="
                         f"{params.max_tokens} exceeds this engine's max_request_tokens={max_request_tokens}")
