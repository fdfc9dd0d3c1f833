"""Tokenizers rebuilt from the vocabulary a GGUF file carries in its metadata.

A GGUF has no tokenizer.json: llama.cpp stores the pieces (`tokenizer.ggml.tokens`), their kinds
(`token_type`), BPE merges or sentencepiece scores, and the name of the pre-tokenizer
(`tokenizer.ggml.pre`). Two vocabulary kinds are rebuilt:

  "gpt2"   byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM2) -> a HF `tokenizers.Tokenizer`: the
           pieces are spelled in the GPT-2 byte alphabet, the merges are given, and the split
           regex comes from `pre`. CONTROL pieces become special added tokens and USER_DEFINED
           pieces plain added tokens, so both are matched whole in text, as llama.cpp does.
  "llama"  sentencepiece BPE (Llama 2, Mistral, Gemma) -> a sentencepiece model proto: pieces,
           scores and types map one to one onto sentencepiece's own model, so sentencepiece
           tokenizes. llama.cpp writes user-defined runs of spaces (Gemma's "  ", "   ", ...) with
           real spaces; sentencepiece matches text whose spaces are already "▁", so those pieces
           are spelled with "▁" again.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# llama.cpp's token kinds (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# `tokenizer.ggml.pre` -> the regexes llama.cpp splits with, in order (each "isolated").
# Names not listed fall back to the GPT-2 regex, which is what "gpt2"/"default" mean.
_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("llama3", "llama-bpe", "llama-v3", "smaug-bpe", "falcon3", "dbrx", "pixtral"), (_LLAMA3_SPLIT,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), (_QWEN2_SPLIT,)),
    **dict.fromkeys(("gpt-4o", "llama4"), (_GPT4O_SPLIT,)),
    # StarCoder-style vocabularies split every digit on its own before the GPT-2 regex.
    **dict.fromkeys(("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone"), (r"\p{N}", _GPT2_SPLIT)),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the rest are shifted past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shift = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shift)
            shift += 1
    return table


def field_value(metadata: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """A metadata value from either plain values or `gguf.GGUFReader().fields` (ReaderField)."""
    value = metadata.get(key, default)
    return value.contents() if hasattr(value, "contents") else value


def byte_level_bpe(metadata: Mapping[str, Any]) -> HFTokenizer:
    """A `tokenizers.Tokenizer` for a "gpt2" GGUF vocabulary. It has no post-processor: the
    caller adds BOS/EOS itself, from `tokenizer.ggml.add_bos_token`."""
    tokens = list(field_value(metadata, "tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
    types = list(field_value(metadata, "tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for index, (token, kind) in enumerate(zip(tokens, types)):
        # A few converters store ordinary pieces as raw text; respell those in the byte alphabet.
        # Control/user-defined pieces keep their text: they are matched whole, never byte-merged.
        if kind not in (CONTROL, USER_DEFINED) and not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    merges = [tuple(m.split(" ", 1)) for m in field_value(metadata, "tokenizer.ggml.merges") or []]
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = field_value(metadata, "tokenizer.ggml.pre", "default")
    splits = _PRE_SPLITS.get(pre, (_GPT2_SPLIT,))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    _add_whole_tokens(tokenizer, tokens, types)
    return tokenizer


def sentencepiece_model_proto(metadata: Mapping[str, Any]) -> bytes:
    """A serialized sentencepiece ModelProto (BPE, byte fallback) for a "llama" GGUF vocabulary.

    sentencepiece itself then tokenizes: llama.cpp's SPM tokenizer follows it exactly (including
    ties between equal scores, which go to the leftmost pair), which a ranked merge list cannot.
    The GGUF token types use sentencepiece's own numbering. Only the few fields that matter are
    written (protobuf wire format by hand, so no protobuf dependency)."""
    tokens = list(field_value(metadata, "tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
    scores = list(field_value(metadata, "tokenizer.ggml.scores") or [0.0] * len(tokens))
    types = list(field_value(metadata, "tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    add_space = bool(field_value(metadata, "tokenizer.ggml.add_space_prefix", True))
    tokens = ["▁" * len(t) if kind == USER_DEFINED and t and not t.strip(" ") else t for t, kind in zip(tokens, types)]
    pieces = b"".join(
        _message(1, _string(1, token.encode("utf-8")) + _float(2, score) + _varint_field(3, kind))
        for token, score, kind in zip(tokens, scores, types)
    )
    trainer = _varint_field(3, 2) + _varint_field(35, 1)  # model_type=BPE, byte_fallback=true
    normalizer = (
        _string(1, b"identity")
        + _varint_field(3, add_space)  # add_dummy_prefix
        + _varint_field(4, 0)
        + _varint_field(5, 1)
    )  # no whitespace cleanup; "▁" escape
    return pieces + _message(2, trainer) + _message(3, normalizer)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _varint_field(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(int(value))


def _string(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


_message = _string


def _float(number: int, value: float) -> bytes:
    return _varint(number << 3 | 5) + struct.pack("<f", value)


def _add_whole_tokens(tokenizer: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    if control:
        tokenizer.add_special_tokens(control)
    if user:
        tokenizer.add_tokens(user)
