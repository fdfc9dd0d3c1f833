"""A request's prompt as token ids: text through the tokenizer, ids as they are (no JAX).

Checking the ids (empty, out of the vocabulary) is core/requests.py's, once for every way in.
"""

from __future__ import annotations

from typing import Protocol


class Encoder(Protocol):
    """What a prompt reads of a tokenizer (jaxinfer.tokenizer's Tokenizer: core imports none)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def tokenize_prompt(prompt: object, tokenizer: Encoder | None) -> tuple[str | None, list[int]]:
    """(the prompt text or None, its token ids). ValueError for a wrong type, empty text, or
    text without a tokenizer."""
    if not isinstance(prompt, (str, list, tuple)) and not hasattr(prompt, "tolist"):
        raise ValueError(f"prompt={prompt!r:.60}: must be a string or a list of token ids")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        if tokenizer is None:
            raise ValueError("this engine has no tokenizer: pass prompt token ids")
        return prompt, tokenizer.encode(prompt)
    listed = list(prompt) if isinstance(prompt, (list, tuple)) else None
    ids = prompt.tolist() if hasattr(prompt, "tolist") else listed  # numpy arrays too
    if not isinstance(ids, list):
        raise ValueError(f"prompt={prompt!r:.60}: must be a string or a list of token ids")
    return None, ids
