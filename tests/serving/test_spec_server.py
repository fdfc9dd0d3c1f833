"""Speculative decoding behind the server (loopback, the tiny Llama with n-gram drafts): the
per-request switch over gRPC (SamplingOptions.speculative) and HTTP (the `speculative` extra),
drafted / accepted tokens in the gRPC usage, and the Prometheus counters and gauges."""

import urllib.request

import openai
import pytest
from serving_support import client_of
from testpaths import FIXTURES

from jaxinfer.llm import LLM
from jaxinfer.sampling import SamplingParams

PROMPT = [5, 6, 7, 8, 9, 10, 11] * 4  # repeats: the n-gram lookup has drafts at once


@pytest.fixture(scope="module")
def spec_llm():
    return LLM(
        str(FIXTURES / "hf" / "llama3"),
        "float32",
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        token_buckets=(8, 32),
        num_pages=48,
        penalties=False,
        speculative_config='{"method": "ngram", "num_speculative_tokens": 3}',
    )


def test_switch_usage_and_metrics(serve, spec_llm):
    want = (
        spec_llm.generate(
            PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, speculative=False), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    server = serve(engine=spec_llm.engine, http_port=0, metrics_port=0)
    with client_of(server) as client:
        on = client.generate(PROMPT, max_tokens=24, temperature=0, ignore_eos=True, timeout=60)
        off = client.generate(PROMPT, max_tokens=24, temperature=0, ignore_eos=True, speculative=False, timeout=60)
    assert on.token_ids == off.token_ids == want
    assert on.usage.draft_tokens > 0 and 0 <= on.usage.accepted_draft_tokens <= on.usage.draft_tokens
    assert off.usage.draft_tokens == 0
    http = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none", max_retries=0)
    for extra in ({"ignore_eos": True}, {"ignore_eos": True, "speculative": False}):
        done = http.completions.create(
            model="llama3", prompt=PROMPT, max_tokens=24, temperature=0, logprobs=0, extra_body=extra
        )
        assert [int(t.removeprefix("token_id:")) for t in done.choices[0].logprobs.tokens] == want
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics", timeout=10).read().decode()
    values = {
        line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("jaxinfer_spec_decode")
    }
    assert values["jaxinfer_spec_decode_draft_tokens_total"] >= 2 * on.usage.draft_tokens
    assert values["jaxinfer_spec_decode_verify_steps_total"] > 0
    accepted = values["jaxinfer_spec_decode_accepted_tokens_total"]
    assert values["jaxinfer_spec_decode_acceptance_rate"] == pytest.approx(
        accepted / values["jaxinfer_spec_decode_draft_tokens_total"]
    )
    assert values["jaxinfer_spec_decode_mean_accepted_length"] >= 1
