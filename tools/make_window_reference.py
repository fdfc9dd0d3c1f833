"""Writes tests/fixtures/sliding_window.json: HF transformers greedy continuations on the tiny
random checkpoints whose layers slide (gemma3: sliding and full layers mixed; gemma2: alternating;
mistral: every layer slides), over contexts many windows long, so CI can check that sliding-window
layers keeping only their window's pages give the same tokens.

Run it in the reference environment of make_reference.py (see tools/README.md):

    /work/refenv/bin/python tools/make_window_reference.py

Per model: one shared prefix and three suffixes (so a second pass hits the prefix cache), each
prompt + continuation many windows long; every continuation is a pure argmax chain checked against
a teacher-forced forward pass with a top-1/top-2 logit margin of at least make_reference's
MIN_MARGIN (suffixes are redrawn until it holds).
"""

from __future__ import annotations

import json

import make_reference as ref
import numpy as np
import torch
from transformers import AutoModelForCausalLM

OUT = ref.FIXTURES / "sliding_window.json"
CASES = {"gemma3": (37, (11, 45, 77)), "gemma2": (29, (8, 40, 70)), "mistral": (41, (9, 50, 83))}  # prefix, suffixes
NEW_TOKENS = 40


def main() -> None:
    torch.manual_seed(0)
    rng = np.random.default_rng(20261128)
    out = {"new_tokens": NEW_TOKENS, "models": {}}
    for name, (prefix_len, suffix_lens) in CASES.items():
        model = AutoModelForCausalLM.from_pretrained(ref.HF_DIR / name, dtype=torch.float32).eval()
        window = model.config.sliding_window
        vocab = model.config.vocab_size
        prefix = rng.integers(0, vocab, prefix_len).astype(np.int32)
        prompts, outputs = [], []
        for n in suffix_lens:
            for attempt in range(1, 101):
                ids = np.concatenate([prefix, rng.integers(0, vocab, n).astype(np.int32)])
                greedy, margin = ref.greedy_generate(model, ids, NEW_TOKENS)
                if margin >= ref.MIN_MARGIN and len(set(greedy.tolist())) >= NEW_TOKENS // 4:
                    print(f"  {name} suffix {n}: draw {attempt}, margin {margin:.4f}, window {window}")
                    break
            else:
                raise RuntimeError(f"{name}: no robust suffix of {n} tokens in 100 draws")
            prompts.append(ids.tolist())
            outputs.append(greedy.tolist())
        out["models"][name] = {"window": window, "prompts": prompts, "outputs": outputs}
    OUT.write_text(json.dumps(out) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
