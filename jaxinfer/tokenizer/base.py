"""The Tokenizer protocol and its two backends (HF `tokenizers`, `sentencepiece`).

Which ids begin and end a sequence comes from the checkpoint's own files (special_tokens.py):
BOS/EOS/PAD, whether BOS is added, every id that ends generation, the chat template. `encode`
never relies on a backend's post-processor: it adds BOS/EOS itself, so all backends agree.
Special tokens written in the text are matched whole; `decode(skip_special_tokens=True)` is
`decode` of the ids with the special ones removed, which the incremental detokenizer relies on.
Where a backend comes from (a model directory, a tokenizer file, a GGUF vocabulary) is load.py's
business.
"""

from __future__ import annotations

import abc
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import sentencepiece
import tokenizers

from jaxinfer.tokenizer.chat_template import render_chat_template
from jaxinfer.tokenizer.special_tokens import SpecialTokens


class TokenizerError(ValueError):
    """A tokenizer that cannot be read or used; the message names its source."""


@runtime_checkable
class Tokenizer(Protocol):
    name: str  # where it came from, for messages
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # every id that ends generation
    pad_token_id: int | None
    add_bos: bool
    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str: ...
    def id_to_token(self, i: int) -> str | None: ...  # None: no such id (HF tokenizers)
    def is_special(self, i: int) -> bool: ...
    def save_pretrained(self, directory: str | Path) -> None: ...
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str: ...


class _Base(abc.ABC):
    """What every backend shares once it knows its special ids and the checkpoint's settings."""

    def _init_common(self, name: str, vocab_size: int, special_ids: set[int], specials: SpecialTokens) -> None:
        self.name, self.vocab_size, self._special_ids = name, vocab_size, frozenset(special_ids)
        self.bos_token_id, self.pad_token_id = specials.bos_token_id, specials.pad_token_id
        self.eos_token_ids = specials.eos_token_ids
        self.add_bos, self.add_eos = bool(specials.add_bos), bool(specials.add_eos)  # resolved: set
        self.chat_template = specials.chat_template
        self._template_tokens = specials.token_strings

    def is_special(self, i: int) -> bool:
        return i in self._special_ids

    def _wrap(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        if not add_special_tokens:
            return ids
        head = [self.bos_token_id] if self.add_bos and self.bos_token_id is not None else []
        tail = [self.eos_token_ids[0]] if self.add_eos and self.eos_token_ids else []
        return head + ids + tail

    def save_pretrained(self, directory: str | Path) -> None:
        """Writes the files `load_tokenizer(directory)` reads back as an equal tokenizer: the
        backend's own file, tokenizer_config.json (token texts, add_bos/add_eos, the chat template)
        and generation_config.json (bos, every id that ends generation, pad)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._save_backend(directory)
        config: dict[str, Any] = {**self._template_tokens, "add_bos_token": self.add_bos, "add_eos_token": self.add_eos}
        if self.chat_template:
            config["chat_template"] = self.chat_template
        generation = {
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
            "pad_token_id": self.pad_token_id,
        }
        for name, record in (("tokenizer_config.json", config), ("generation_config.json", generation)):
            (directory / name).write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    @abc.abstractmethod
    def _save_backend(self, directory: Path) -> None:
        """Writes the backend's own file (tokenizer.json or tokenizer.model) into `directory`."""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if not self.chat_template:
            raise TokenizerError(f"tokenizer {self.name} has no chat template")
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            **{**self._template_tokens, **kwargs},
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, vocab_size={self.vocab_size})"


class HFTokenizer(_Base):
    """A HF `tokenizers.Tokenizer` (from tokenizer.json, or rebuilt from a GGUF vocabulary)."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        name: str,
        specials: SpecialTokens | None = None,
        special_ids: Iterable[int] | None = None,
    ):
        self._tk = backend
        added = backend.get_added_tokens_decoder()
        if special_ids is None:
            special_ids = {i for i, tok in added.items() if tok.special}
        self._tk.no_padding()
        self._tk.no_truncation()
        specials = (specials or SpecialTokens()).with_defaults(_post_processor_specials(backend))
        self._init_common(
            name,
            backend.get_vocab_size(with_added_tokens=True),
            set(special_ids),
            specials.resolved(backend.token_to_id),
        )

    def _save_backend(self, directory: Path) -> None:
        self._tk.save(str(directory / "tokenizer.json"))

    def backend_json(self) -> str:
        """The `tokenizers` tokenizer as tokenizer.json text (grammar engines read it)."""
        return self._tk.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._wrap(self._tk.encode(text, add_special_tokens=False).ids, add_special_tokens)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        return self._tk.decode(ids, skip_special_tokens=False)

    def id_to_token(self, i: int) -> str | None:
        return self._tk.id_to_token(int(i))


class SentencePieceTokenizer(_Base):
    """A sentencepiece model. Control and unknown pieces written in the text ("<s>", "<unk>")
    are matched whole; each run of text between them is encoded by sentencepiece on its own,
    with its dummy-prefix space, as llama.cpp does."""

    def __init__(
        self, processor: sentencepiece.SentencePieceProcessor, name: str, specials: SpecialTokens | None = None
    ):
        self._sp = processor
        n = processor.get_piece_size()
        special_ids = {i for i in range(n) if processor.is_control(i) or processor.is_unknown(i)}
        self._special_by_text = {processor.id_to_piece(i): i for i in special_ids}
        pieces = sorted(self._special_by_text, key=len, reverse=True)
        pattern = "|".join(map(re.escape, pieces))
        self._special_re = re.compile(f"({pattern})") if pieces else None
        defaults = SpecialTokens(
            bos_token_id=_nonneg(processor.bos_id()),
            pad_token_id=_nonneg(processor.pad_id()),
            eos_token_ids=tuple(i for i in [processor.eos_id()] if i >= 0),
            add_bos=True,
        )
        merged = (specials or SpecialTokens()).with_defaults(defaults)
        self._init_common(name, n, special_ids, merged.resolved(self._piece_id))

    def _save_backend(self, directory: Path) -> None:
        (directory / "tokenizer.model").write_bytes(self._sp.serialized_model_proto())

    def _piece_id(self, piece: str) -> int | None:
        i = self._sp.piece_to_id(piece)
        return i if self._sp.id_to_piece(i) == piece else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        parts = self._special_re.split(text) if self._special_re else [text]
        ids: list[int] = []
        for k, part in enumerate(parts):  # odd positions are the matched special pieces
            if k % 2:
                ids.append(self._special_by_text[part])
            elif part:
                ids.extend(self._sp.encode(part))
        return self._wrap(ids, add_special_tokens)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            return self._sp.decode([i for i in ids if i not in self._special_ids])
        # The inverse of encode: each run of ordinary pieces is decoded on its own (which drops
        # the "▁" its encoding added), special pieces are written as their text.
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self._special_ids:
                out += [self._sp.decode(run), self._sp.id_to_piece(i)]
                run = []
            else:
                run.append(i)
        out.append(self._sp.decode(run))
        return "".join(out)

    def id_to_token(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))


def _post_processor_specials(backend: tokenizers.Tokenizer) -> SpecialTokens:
    """What tokenizer.json's post-processor adds around a text (used when tokenizer_config.json
    does not say add_bos_token / add_eos_token)."""
    bare = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            head, tail = full[:start], full[start + len(bare) :]
            return SpecialTokens(
                bos_token_id=head[0] if head else None,
                eos_token_ids=tuple(tail[-1:]),
                add_bos=bool(head),
                add_eos=bool(tail),
            )
    return SpecialTokens()


def _nonneg(i: int) -> int | None:
    return i if i >= 0 else None
