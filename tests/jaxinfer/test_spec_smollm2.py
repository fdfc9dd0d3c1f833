"""Speculative decoding on the embedded SmolLM2 (real tokenizer): greedy outputs equal
transformers' goldens with n-gram drafts and with SmolLM2 as its own draft model (which must
accept every draft); stop strings inside accepted runs cut exactly as plain decoding does; the
CLI flag reaches the engine and bad configs exit 2 naming the bad value."""

import dataclasses

import numpy as np
import pytest
from testpaths import FIXTURES

from jaxinfer import cli
from jaxinfer.llm import LLM
from jaxinfer.loader import default_model_path, load_model
from jaxinfer.sampling import SamplingParams

GOLDEN = np.load(FIXTURES / "smollm2" / "golden.npz")
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
# One 16-token bucket (prompts prefill in chunks), no penalty variant, no decode windows: two
# compiled steps (plain and verify) per engine.
SMALL = dict(
    max_model_len=512,
    max_num_batched_tokens=16,
    token_buckets=(16,),
    max_num_seqs=4,
    penalties=False,
    num_decode_steps=1,
)


@pytest.fixture(scope="module")
def smollm2():
    return load_model(dtype="float32")  # one load for the module's engines


def greedy(**kw):
    return SamplingParams(temperature=0, **{"max_tokens": 32, **kw})


@pytest.mark.parametrize(
    "argv,match",
    [
        (["generate", "hi", "--speculative-config", "{bad"], "--speculative-config '{bad': not valid JSON"),
        (
            ["generate", "hi", "--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}'],
            "speculative_config.method='medusa'",
        ),
        (
            ["generate", "hi", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 99}'],
            "speculative_config.num_speculative_tokens=99",
        ),
    ],
)
def test_cli_flag_errors_exit_2(capsys, argv, match):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and match in err


@pytest.mark.slow
def test_ngram_on_smollm2_matches_transformers(smollm2):
    llm = LLM(
        smollm2, **SMALL, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    )
    prompt = llm.render_chat(QUESTION)
    out = llm.generate(prompt, greedy(ignore_eos=True, skip_special_tokens=False), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == GOLDEN["greedy"].tolist()
    assert out.metrics.num_accepted_tokens > 0  # the chain repeats the chat's role markers
    chat = llm.chat(QUESTION, greedy(), use_tqdm=False)[0].outputs[0]
    assert chat.token_ids == GOLDEN["greedy"][: int(GOLDEN["greedy_stops_at"]) + 1].tolist()
    for stops in ([" Paris."], ["<|im_start|>user"]):
        params = greedy(stop=stops, ignore_eos=True, skip_special_tokens=False, max_tokens=40)
        got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        plain = llm.generate(prompt, dataclasses.replace(params, speculative=False), use_tqdm=False)[0].outputs[0]
        assert (got.text, got.token_ids, got.stop_reason) == (plain.text, plain.token_ids, plain.stop_reason)
        assert got.finish_reason == "stop" and stops[0] not in got.text


@pytest.mark.slow
def test_smollm2_as_its_own_draft_accepts_every_token(smollm2):
    spec = {"method": "draft_model", "model": str(default_model_path()), "num_speculative_tokens": 4}
    llm = LLM(smollm2, **SMALL, speculative_config=spec)
    out = llm.chat(QUESTION, greedy(ignore_eos=True, skip_special_tokens=False), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == GOLDEN["greedy"].tolist()
    m = out.metrics
    assert m.num_draft_tokens >= 20 and m.num_accepted_tokens == m.num_draft_tokens
    assert m.mean_accepted_length == pytest.approx(5.0, abs=0.5)
    # every token is accepted, so the stop string ends inside an accepted run
    cut = llm.chat(QUESTION, greedy(stop=[" Paris."]), use_tqdm=False)[0]
    assert (cut.outputs[0].text, cut.outputs[0].finish_reason) == ("The capital of France is", "stop")
    assert cut.metrics.num_accepted_tokens == cut.metrics.num_draft_tokens > 0
