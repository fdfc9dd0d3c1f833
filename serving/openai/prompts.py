"""A completion request's `prompt` -> one list of token ids per prompt.

    prompt: "text" | [ids] | ["text", ...] | [[ids], ...]
        -> prompt_shapes (a 400 naming the shape or the element: `prompt[1][3]`)
        -> completion_prompts: text tokenized, ids range-checked against the vocabulary,
           at most limits.max_n prompts, each named `prompt` or `prompt[i]` in errors

Plain functions, no I/O (tokenizing runs on a worker thread), called by inputs.py. Chat
messages become the prompt in messages.py instead.
"""

from __future__ import annotations

from typing import Any

from jaxinfer.tokenizer import Tokenizer
from serving.model_limits import ModelLimits
from serving.openai.errors import bad_request


def as_list(prompt: object) -> list[Any]:  # the request's JSON value, and its elements
    """The prompts of a completion request: one unless it is a list of strings or of id lists."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return prompt
    return [prompt]


def _token_ids(value: object, field: str) -> list[int] | None:
    """A non-empty list of numbers as token ids, None for any other value. Integral numbers
    written as floats (272.0) are ids, as in vLLM's API (JSON Schema's integer); any other number
    is a 400 naming the element (`prompt[3]: 272.5 is not an integer token id`)."""
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in value)
    ):
        return None
    for j, t in enumerate(value):
        if isinstance(t, float) and not t.is_integer():
            raise bad_request(field, f"{field}[{j}]: {t!r} is not an integer token id")
    return [int(t) for t in value]


def prompt_shapes(prompt: object) -> list[str | list[int]]:
    """The prompts of a completion request: a string, token ids, or a non-empty list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if (ids := _token_ids(prompt, "prompt")) is not None:
        return [ids]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        lists = [_token_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        if all(ids is not None for ids in lists):
            return [ids for ids in lists if ids is not None]
    raise bad_request(
        "prompt",
        "prompt: must be a string, a list of strings, a list of token ids or a list of token-id lists (none empty)",
    )


def completion_prompts(prompt: object, tokenizer: Tokenizer | None, limits: ModelLimits) -> list[list[int]]:
    """Each prompt as token ids. Text is tokenized as /tokenize does it; an empty string is a
    prompt when the tokenizer gives it a token (BOS), and refused when it gives none, as vLLM
    refuses a prompt of no tokens: generation has nothing to start from."""
    prompts = prompt_shapes(prompt)
    if len(prompts) > limits.max_n:
        raise bad_request("prompt", f"prompt: {len(prompts)} prompts in one request; at most {limits.max_n}")
    out = []
    for i, p in enumerate(prompts):
        field = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            if tokenizer is None:
                raise bad_request(field, f"{field}: this model has no tokenizer; send token ids")
            ids = tokenizer.encode(p)
            if not ids:
                raise bad_request(field, f"{field}: the prompt has no tokens; a completion needs at least one")
        else:
            ids = p
            bad = [t for t in ids if not 0 <= t < limits.vocab_size]
            if bad:
                raise bad_request(field, f"{field}: token ids out of range [0, {limits.vocab_size}): {bad[:5]}")
        out.append(ids)
    return out
