"""Tokenizers: one Tokenizer protocol over HF tokenizers, sentencepiece and GGUF vocabularies
(no JAX).

    base.py            the Tokenizer protocol, TokenizerError, the two backends
    load.py            load_tokenizer(path), from_gguf_metadata(fields)
    gguf_vocab.py      a GGUF's vocabulary rebuilt as a HF tokenizer or a sentencepiece model
    special_tokens.py  BOS/EOS/PAD and the chat template from the checkpoint's own files, and
                       TokenizerDefaults: what a GGUF's model family implies where it is silent
    chat_template.py   rendering chat templates (sandboxed jinja2, as HF renders them)
    detokenizer.py     IncrementalDetokenizer: streamed ids -> text
    tool_calls.py      tool calls read out of output text, in the format a chat template teaches
"""

from jaxinfer.tokenizer.base import HFTokenizer, SentencePieceTokenizer, Tokenizer, TokenizerError
from jaxinfer.tokenizer.detokenizer import IncrementalDetokenizer
from jaxinfer.tokenizer.load import from_gguf_metadata, load_tokenizer
from jaxinfer.tokenizer.special_tokens import TokenizerDefaults

__all__ = [
    "Tokenizer",
    "TokenizerError",
    "HFTokenizer",
    "SentencePieceTokenizer",
    "IncrementalDetokenizer",
    "load_tokenizer",
    "from_gguf_metadata",
    "TokenizerDefaults",
]
