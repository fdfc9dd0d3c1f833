"""Writes tests/fixtures/hf/llama3_chat: the random llama3 fixture's weights (symlinked) with a
tokenizer of its 512-token vocabulary (a byte-level BPE trained here on the project's docs) and a
chat template, so that servers of the tiny model answer chat completions (the serving tests that
need chat without loading SmolLM2).

    python tools/make_chat_fixture.py
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "hf" / "llama3_chat"
SPECIAL = ["<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        link = OUT / name
        if not link.is_symlink():
            link.symlink_to(Path("..") / "llama3" / name)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    docs = sorted((ROOT / "docs").rglob("*.md"))
    tokenizer.train([str(p) for p in docs], trainer)
    assert tokenizer.get_vocab_size() <= 512, tokenizer.get_vocab_size()
    tokenizer.save(str(OUT / "tokenizer.json"))
    config = {
        "bos_token": None,
        "eos_token": "<|end|>",
        "chat_template": TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (OUT / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    main()
