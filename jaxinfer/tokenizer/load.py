"""Finding and building a tokenizer: a model directory, a tokenizer file, or a GGUF vocabulary.

load_tokenizer(path)
  model dir with tokenizer.json   -> HFTokenizer            (HF `tokenizers`)
  model dir with tokenizer.model  -> SentencePieceTokenizer (`sentencepiece`)
  file.gguf (vocabulary in its metadata), or a dir holding exactly one .gguf
    "gpt2" vocab                  -> HFTokenizer built by gguf_vocab.byte_level_bpe
    "llama" vocab                 -> SentencePieceTokenizer over gguf_vocab's model proto
from_gguf_metadata(fields, defaults)  -> the same, from metadata the model loader already read,
                                     with what the model's family implies where it is silent
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import sentencepiece
import tokenizers

import jaxinfer.tokenizer.gguf_vocab as gguf_vocab
from jaxinfer.tokenizer.base import HFTokenizer, SentencePieceTokenizer, Tokenizer, TokenizerError
from jaxinfer.tokenizer.special_tokens import TokenizerDefaults, from_gguf, from_model_dir

NO_DEFAULTS = TokenizerDefaults()  # a family that implies nothing


def from_gguf_metadata(
    metadata: Mapping[str, Any], name: str = "GGUF metadata", defaults: TokenizerDefaults = NO_DEFAULTS
) -> Tokenizer:
    """The tokenizer a GGUF describes. `metadata` is `gguf.GGUFReader(path).fields`, or a plain
    {key: value} dict with the same keys; `defaults` fill in what the file leaves unsaid."""
    kind = gguf_vocab.field_value(metadata, "tokenizer.ggml.model")
    try:
        tokens = list(gguf_vocab.field_value(metadata, "tokenizer.ggml.tokens") or [])
        specials = from_gguf(metadata, tokens, defaults)
        if kind == "gpt2":
            backend = gguf_vocab.byte_level_bpe(metadata)
            types = gguf_vocab.field_value(metadata, "tokenizer.ggml.token_type") or []
            control = {i for i, t in enumerate(types) if t == gguf_vocab.CONTROL}
            return HFTokenizer(backend, name, specials, special_ids=control)
        if kind == "llama":
            proto = gguf_vocab.sentencepiece_model_proto(metadata)
            return SentencePieceTokenizer(sentencepiece.SentencePieceProcessor(model_proto=proto), name, specials)
    except (ValueError, RuntimeError, TypeError, IndexError, KeyError) as e:
        raise TokenizerError(f"cannot build a tokenizer from {name}: {e}") from e
    raise TokenizerError(f"{name}: unsupported tokenizer.ggml.model {kind!r} (supported: 'gpt2', 'llama')")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a model directory, of a tokenizer.json or sentencepiece model file (with
    the configs beside it), or of a GGUF file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer path does not exist: {path}")
    if path.is_file():
        with open(path, "rb") as f:
            if f.read(4) == b"GGUF":
                return _load_gguf(path)
        return _load_file(path, path.parent)  # tokenizer.json, else a sentencepiece model
    for filename in ("tokenizer.json", "tokenizer.model"):
        if (path / filename).is_file():
            return _load_file(path / filename, path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _load_gguf(ggufs[0])
    found = f"{len(ggufs)} .gguf files" if ggufs else "no tokenizer.json, tokenizer.model or .gguf"
    raise TokenizerError(f"no tokenizer in {path}: {found}")


def _load_file(file: Path, model_dir: Path) -> Tokenizer:
    try:
        specials = from_model_dir(model_dir)
    except ValueError as e:  # a config file that is not JSON; the message names it
        raise TokenizerError(str(e)) from e
    try:
        if file.suffix == ".json":
            return HFTokenizer(tokenizers.Tokenizer.from_file(str(file)), str(file), specials)
        processor = sentencepiece.SentencePieceProcessor(model_file=str(file))
        return SentencePieceTokenizer(processor, str(file), specials)
    except Exception as e:  # both libraries raise bare Exception/RuntimeError on bad files
        raise TokenizerError(f"cannot read tokenizer {file}: {e}") from e


def _load_gguf(path: Path) -> Tokenizer:
    import gguf  # only GGUF users pay for importing it

    try:
        fields = gguf.GGUFReader(str(path)).fields
    except Exception as e:  # gguf raises ValueError/struct.error/... on a bad file
        raise TokenizerError(f"cannot read GGUF file {path}: {e}") from e
    if "tokenizer.ggml.tokens" not in fields:
        raise TokenizerError(f"GGUF file {path} has no tokenizer (no tokenizer.ggml.tokens)")
    return from_gguf_metadata(fields, name=str(path))
