"""Which ids begin, end and pad a sequence, read from the checkpoint's own files.

    model dir: tokenizer_config.json      bos_token / eos_token / pad_token / unk_token (a string,
                                          or an AddedToken dict), add_bos_token, add_eos_token,
                                          chat_template (a string, or [{name, template}])
               special_tokens_map.json    the same token names, when tokenizer_config lacks them
               generation_config.json     eos_token_id (int or list), bos_token_id, pad_token_id
                                          (config.json stands in when it is absent)
               chat_template.jinja        the chat template (wins over tokenizer_config's)
    GGUF:      tokenizer.ggml.{bos,eos,eot,eom,padding,unknown}_token_id, add_bos_token,
               add_eos_token, tokenizer.chat_template; where the file is silent, what its model
               family implies (`TokenizerDefaults`, which the loader passes: e.g. Gemma's turn
               format and <end_of_turn>)

`eos_token_ids` collects every id that ends generation: the tokenizer's eos token, then the
generation config's list (e.g. <|im_end|>, <|eot_id|>), then GGUF's eot/eom ids.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from jaxinfer.tokenizer.gguf_vocab import field_value

_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


@dataclasses.dataclass(frozen=True)
class TokenizerDefaults:
    """What a GGUF's model family implies where its tokenizer metadata is silent (llama.cpp knows
    these by architecture): the chat template, and texts of tokens that end generation beyond
    the file's EOS/EOT ids. The loader passes its family's (jaxinfer.config.families)."""

    chat_template: str | None = None
    end_tokens: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    add_bos: bool | None = None
    add_eos: bool | None = None
    chat_template: str | None = None
    # Token texts by name ("bos_token": "<s>", ...); rendered into chat templates.
    token_strings: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def with_defaults(self, defaults: SpecialTokens) -> SpecialTokens:
        """Each unset field taken from `defaults`."""
        merged = {}
        for f in dataclasses.fields(self):
            mine = getattr(self, f.name)
            merged[f.name] = mine if mine not in (None, (), {}) else getattr(defaults, f.name)
        merged["token_strings"] = {**defaults.token_strings, **self.token_strings}
        return SpecialTokens(**merged)

    def resolved(self, token_to_id: Callable[[str], int | None]) -> SpecialTokens:
        """Ids for the named tokens (a named token wins over a bare id), flags made bools."""
        named = {name: token_to_id(text) for name, text in self.token_strings.items()}
        eos = [named.get("eos_token"), *self.eos_token_ids]
        bos = named.get("bos_token")
        pad = named.get("pad_token")
        return dataclasses.replace(
            self,
            bos_token_id=bos if bos is not None else self.bos_token_id,
            pad_token_id=pad if pad is not None else self.pad_token_id,
            eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos if i is not None)),
            add_bos=bool(self.add_bos),
            add_eos=bool(self.add_eos),
        )


def from_model_dir(model_dir: Path) -> SpecialTokens:
    tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
    special_map = _read_json(model_dir / "special_tokens_map.json")
    generation = _read_json(model_dir / "generation_config.json")
    if not (model_dir / "generation_config.json").is_file():
        generation = _read_json(model_dir / "config.json")
    strings = {}
    for name in _TOKEN_NAMES:
        value = tokenizer_config.get(name) or special_map.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            strings[name] = value
    template_file = model_dir / "chat_template.jinja"
    template = (
        template_file.read_text(encoding="utf-8")
        if template_file.is_file()
        else _pick_template(tokenizer_config.get("chat_template"))
    )
    return SpecialTokens(
        bos_token_id=_int_or_none(generation.get("bos_token_id")),
        eos_token_ids=_ids(generation.get("eos_token_id")),
        pad_token_id=_int_or_none(generation.get("pad_token_id")),
        add_bos=tokenizer_config.get("add_bos_token"),
        add_eos=tokenizer_config.get("add_eos_token"),
        chat_template=template,
        token_strings=strings,
    )


def from_gguf(
    metadata: Mapping[str, Any], tokens: list[str], defaults: TokenizerDefaults = TokenizerDefaults()
) -> SpecialTokens:
    def token_id(key: str) -> int | None:
        value = _int_or_none(field_value(metadata, f"tokenizer.ggml.{key}"))
        return value if value is not None and 0 <= value < len(tokens) else None

    ids = {
        name: token_id(f"{key}_token_id")
        for name, key in [
            ("bos_token", "bos"),
            ("eos_token", "eos"),
            ("pad_token", "padding"),
            ("unk_token", "unknown"),
        ]
    }
    enders = [ids["eos_token"], token_id("eot_token_id"), token_id("eom_token_id")]
    enders += [tokens.index(text) for text in defaults.end_tokens if text in tokens]
    add_bos = field_value(metadata, "tokenizer.ggml.add_bos_token")
    if add_bos is None:  # llama.cpp's default: sentencepiece vocabularies start with BOS
        add_bos = field_value(metadata, "tokenizer.ggml.model") == "llama"
    return SpecialTokens(
        bos_token_id=ids["bos_token"],
        pad_token_id=ids["pad_token"],
        eos_token_ids=tuple(dict.fromkeys(i for i in enders if i is not None)),
        add_bos=bool(add_bos),
        add_eos=bool(field_value(metadata, "tokenizer.ggml.add_eos_token")),
        chat_template=field_value(metadata, "tokenizer.chat_template") or defaults.chat_template,
        token_strings={name: tokens[i] for name, i in ids.items() if i is not None},
    )


def _pick_template(value: Any) -> str | None:
    """tokenizer_config's chat_template: a string, or named templates of which "default" is used."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return value


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, (list, tuple)) else [value]
    return tuple(int(v) for v in values if v is not None)


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)
