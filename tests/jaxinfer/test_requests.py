"""Requests checked once (jaxinfer/core/requests.py): what can never run is refused with the
numbers and the field named, the same way for the Python API and both servers; a scoring request
(max_tokens=0) may fill the whole context."""

import pytest

from jaxinfer.core.requests import CheckedRequest, RequestError, RequestLimits, check_lengths, check_request
from jaxinfer.sampling import SamplingParams

# 3 usable pages of 4 tokens = 12 tokens of KV, a context of 16
LIMITS = RequestLimits(vocab_size=100, max_model_len=16, page_size=4, num_usable_pages=3)


def refused(ids, params, limits=LIMITS, **kw) -> RequestError:
    with pytest.raises(RequestError) as info:
        check_request(ids, params, limits, **kw)
    return info.value


def test_requests_that_can_never_fit_are_rejected_with_the_numbers():
    e = refused(list(range(10)), SamplingParams(max_tokens=7))
    assert str(e) == "prompt of 10 tokens + max_tokens=7 = 17 tokens exceeds max_model_len=16"
    assert e.field == "max_tokens"
    e = refused(list(range(10)), SamplingParams(max_tokens=4))
    assert str(e) == "prompt of 10 tokens + max_tokens=4 needs 4 KV pages of 4 tokens, but the pool has only 3"
    assert (refused([], SamplingParams()).field, str(refused([], SamplingParams()))) == ("prompt", "prompt is empty")
    assert str(refused([1], SamplingParams(), priority="high")) == "priority='high' must be an int"
    assert str(refused([1, 100], SamplingParams())) == "prompt token ids out of range [0, 100): [100]"
    e = refused(list(range(17)), SamplingParams(max_tokens=0))
    assert (e.field, str(e)) == ("prompt", "prompt of 17 tokens does not fit the context of 16 tokens")
    # 10 + 3 tokens keep KV for 12 (the last sampled token is never fed back): exactly the pool
    checked = check_request(list(range(10)), SamplingParams(max_tokens=3), LIMITS, priority=2)
    assert checked == CheckedRequest(list(range(10)), SamplingParams(max_tokens=3), None, 2)


def test_a_scoring_request_may_fill_the_context():
    wide = RequestLimits(vocab_size=100, max_model_len=16, page_size=4, num_usable_pages=4)
    check_request(
        list(range(16)),
        SamplingParams(max_tokens=0, prompt_logprobs=1),
        RequestLimits(**{**wide.__dict__, "prompt_logprobs": True}),
    )
    e = refused(list(range(16)), SamplingParams(max_tokens=1), wide)
    assert (e.field, str(e)) == (
        "prompt",
        "prompt of 16 tokens fills the context of 16 tokens, leaving no room for "
        "max_tokens=1 (only max_tokens=0, which scores the prompt, may fill it)",
    )
    with pytest.raises(RequestError, match="needs 5 KV pages"):  # the prompt's own KV must fit the pool
        check_lengths(17, SamplingParams(max_tokens=0), RequestLimits(100, 32, page_size=4, num_usable_pages=4))


def test_what_the_engine_was_not_started_for_is_named_in_its_owners_words():
    engine = RequestLimits(vocab_size=100, max_model_len=64, max_request_tokens=20, max_n=4, penalties=False)
    server = RequestLimits(**{**engine.__dict__, "owner": "server"})
    cases = [
        (SamplingParams(n=5), "n", "SamplingParams.n=5: exceeds this engine's max_n=4"),
        (
            SamplingParams(max_tokens=19),
            "max_tokens",
            "SamplingParams.max_tokens=19: exceeds this engine's "
            "max_request_tokens=20 with the prompt's 2 tokens (21 in all)",
        ),
        (
            SamplingParams(logit_bias={100: 1.0}),
            "logit_bias",
            "SamplingParams.logit_bias[100]: token ids out of the vocabulary [0, 100): [100]",
        ),
    ]
    for params, field, message in cases:
        e = refused([1, 2], params, engine)
        assert (e.field, str(e)) == (field, message)
    assert str(refused([1], SamplingParams(repetition_penalty=1.2), engine)).endswith(
        "penalties are off on this engine (started with penalties=False or --no-penalties)"
    )
    assert str(refused([1], SamplingParams(repetition_penalty=1.2), server)).endswith(
        "penalties are off on this server (started with --no-penalties)"
    )
    assert str(refused([1], SamplingParams(prompt_logprobs=0), server)) == (
        "SamplingParams.prompt_logprobs=0: prompt logprobs are off on this server (start it with "
        "--enable-prompt-logprobs)"
    )
    assert str(refused([1], SamplingParams(prompt_logprobs=0), engine)).endswith(
        "(start it with enable_prompt_logprobs=True or --enable-prompt-logprobs)"
    )


def test_without_a_pool_the_kv_check_is_left_out():
    check_request(list(range(40)), SamplingParams(max_tokens=20), RequestLimits(100, 64))


def test_params_must_be_sampling_params():
    with pytest.raises(TypeError, match="params must be SamplingParams or BeamSearchParams, got dict"):
        check_request([1], {"n": 1}, LIMITS)
