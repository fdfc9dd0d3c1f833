"""Beam search against HF transformers `generate(num_beams=W, do_sample=False)` (golden file of
tools/make_beam_reference.py): the same beams in the same order with the same scores on the tiny
random checkpoints (beams ending in EOS and at max_tokens, length penalties 0.5 to 2) and on
SmolLM2-135M through LLM.beam_search (texts too); beside ordinary requests that keep their own
tokens; forked beams share their pages and copy a partly filled one once; every page free at the
end, nothing compiled after warm-up; bad values refused by name."""

import dataclasses
import json

import pytest
from engine_runs import run_requests
from testpaths import FIXTURES

from jaxinfer.config import EngineConfig
from jaxinfer.core.requests import RequestError, RequestLimits, check_request
from jaxinfer.engine import Engine
from jaxinfer.llm import LLM
from jaxinfer.loader import load_model
from jaxinfer.sampling import SamplingParams
from jaxinfer.sampling.beam import BeamSearchParams

CASES = json.loads((FIXTURES / "beam_search.json").read_text())["cases"]
TINY = {name: case for name, case in CASES.items() if not name.startswith("smollm2")}
SMALL = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, token_buckets=(8, 32), num_pages=64)


@pytest.fixture(scope="module")
def engines():
    built = {}
    for path in sorted({case["model"] for case in TINY.values()}):
        model = load_model(FIXTURES.parent.parent / path, dtype="float32", with_tokenizer=False)
        built[path] = Engine(model, EngineConfig(**SMALL, penalties=False))
    return built


@pytest.mark.parametrize("name", sorted(TINY))
def test_beams_match_hf_generate(engines, name, monkeypatch):
    case = TINY[name]
    engine = engines[case["model"]]
    monkeypatch.setattr(engine.scheduler, "eos_token_ids", frozenset(case["eos"]))  # the case's EOS
    copies = []
    copy = engine.worker.copier.copy
    monkeypatch.setattr(engine.worker.copier, "copy", lambda pairs: copies.append(pairs) or copy(pairs))
    compiled = engine.worker.num_compiled()
    params = BeamSearchParams(case["width"], case["max_tokens"], length_penalty=case["length_penalty"])
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = run_requests(engine, [([5, 6, 7], greedy)])[0].outputs[0].token_ids
    out, beside = run_requests(engine, [(case["prompt"], params), ([5, 6, 7], greedy)])
    assert [o.token_ids for o in out.outputs] == [b["tokens"] for b in case["beams"]]
    lp = case["length_penalty"]
    scores = [o.cumulative_logprob / len(o.token_ids) ** lp for o in out.outputs]
    assert scores == pytest.approx([b["score"] for b in case["beams"]], abs=2e-4)
    eos = set(case["eos"])
    reasons = ["stop" if b["tokens"][-1] in eos else "length" for b in case["beams"]]
    assert [o.finish_reason for o in out.outputs] == reasons
    assert beside.outputs[0].token_ids == alone  # an ordinary request in the same batches
    assert copies and all(len(set(dst for _, dst in p[0])) == len(p[0]) for p in copies)  # partial pages, copied
    assert engine.worker.num_compiled() == compiled and engine.worker.copier.num_compiled() == 1
    assert engine.kv_cache.num_free_pages == engine.kv_cache.num_usable_pages
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_smollm2_beams_through_llm_beam_search():
    case = CASES["smollm2_w4"]
    llm = LLM(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, token_buckets=(4, 64), num_pages=48)
    plans, schedule = [], llm.engine.scheduler.schedule
    llm.engine.scheduler.schedule = lambda *a: plans.append(plan := schedule(*a)) or plan
    (out,) = llm.beam_search(
        [case["prompt"]], BeamSearchParams(case["width"], case["max_tokens"], length_penalty=case["length_penalty"])
    )
    assert [s.token_ids for s in out.sequences] == [b["tokens"] for b in case["beams"]]
    assert [s.text for s in out.sequences] == [b["text"].removesuffix("<|im_end|>") for b in case["beams"]]
    assert [s.score for s in out.sequences] == pytest.approx([b["score"] for b in case["beams"]], abs=1e-3)
    assert all(s.finish_reason == "stop" for s in out.sequences)
    # With every seat of the batch taken by the beams, forks still share their parents' pages
    # (the beams not chosen end first): past the prompt's step, each beam computes one token a step.
    assert len(case["prompt"]) < 64 and {e.num_new_tokens for p in plans[1:] for e in p.seqs} == {1}


def test_bad_beam_search_values_are_refused_by_name():
    limits = RequestLimits(vocab_size=100, max_model_len=64, max_n=4, max_num_seqs=6, num_eos=1)
    for kwargs, message in [
        (dict(beam_width=0, max_tokens=4), "beam_width=0: must be an integer >= 1"),
        (dict(beam_width=2, max_tokens=0), "max_tokens=0: must be an integer >= 1"),
        (dict(beam_width=2, max_tokens=4, temperature=0.7), "temperature=0.7: beam search keeps the likeliest"),
        (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty=nan: must be finite"),
    ]:
        with pytest.raises(ValueError, match=message):
            BeamSearchParams(**kwargs)
    for width, limit, message in [
        (5, limits, "beam_width=5: exceeds this engine's max_n=4"),
        (7, dataclasses.replace(limits, max_n=8), "beam_width=7: exceeds this engine's max_num_seqs=6"),
        (11, dataclasses.replace(limits, max_n=16, max_num_seqs=16), r"22 candidates .* beam_width <= 10"),
        (2, dataclasses.replace(limits, no_beam_search="speculative decoding is on"), "speculative decoding is on"),
    ]:
        with pytest.raises(RequestError, match=message) as e:
            check_request([1, 2], BeamSearchParams(width, 4), limit)
        assert e.value.field == "beam_width"


def test_generate_command_runs_a_beam_search(capsys):
    """`jaxinfer generate --chat ... --beam-width 4`: the beams as JSON lines, best first."""
    from jaxinfer.cli import main

    case = CASES["smollm2_w4"]
    argv = ["generate", "--chat", "What is the capital of France? Answer in one sentence.", "--output-format", "jsonl"]
    argv += ["--beam-width", "4", "--max-tokens", str(case["max_tokens"]), "--max-model-len", "128"]
    argv += ["--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--token-buckets", "4,64"]
    assert main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["text"] for line in lines] == [b["text"].removesuffix("<|im_end|>") for b in case["beams"]]
    assert [line["index"] for line in lines] == [0, 1, 2, 3] and all("cumulative_logprob" in line for line in lines)
    assert main(["generate", "hi", "--length-penalty", "2"]) == 2  # only with --beam-width
