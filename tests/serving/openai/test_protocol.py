"""The HTTP API's pure parts, without a server: request bodies -> prompt ids + SamplingParams
(errors name the request's own field), pydantic errors -> OpenAI errors, response and chunk
shapes, SSE framing, API keys, the served model name."""

import json

import pydantic
import pytest
from testpaths import FIXTURES

from jaxinfer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, Usage
from jaxinfer.tokenizer import load_tokenizer
from serving.model_limits import ModelLimits
from serving.openai import outputs, sse
from serving.openai.auth import APIKeys, key_id, read_api_keys
from serving.openai.errors import APIError, from_validation
from serving.openai.inputs import chat_inputs, completion_inputs
from serving.openai.protocol import ChatCompletionRequest, CompletionRequest
from serving.openai.server import served_model_name

LIMITS = ModelLimits(vocab_size=49152, max_model_len=128, penalties_enabled=False, max_n=4)
PENALTIES_ON = ModelLimits(vocab_size=49152, max_model_len=128, penalties_enabled=True, max_n=4)
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(FIXTURES / "smollm2"))


def completion(tok, limits=LIMITS, **body):
    return completion_inputs(CompletionRequest.model_validate({"model": "m", **body}), tok, limits)


def chat(tok, limits=LIMITS, **body):
    return chat_inputs(ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **body}), tok, limits)


def refused(fn, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args, **kwargs)
    assert info.value.status == 400
    return info.value


def test_completion_prompts_of_every_shape(tok):
    hello = tok.encode("Hello")
    assert completion(tok, prompt="Hello").prompts == [hello]
    assert completion(tok, prompt=["Hello", "Hi there"]).prompts == [hello, tok.encode("Hi there")]
    assert completion(tok, prompt=[5, 6, 7]).prompts == [[5, 6, 7]]
    assert completion(tok, prompt=[[5, 6], [7]]).prompts == [[5, 6], [7]]
    inputs = completion(tok, prompt=[[5, 6], [7]], echo=True)
    assert inputs.echo_texts == [tok.decode(ids, skip_special_tokens=False) for ids in ([5, 6], [7])]
    assert completion(tok, prompt="Hello", echo=True).echo_texts == ["Hello"]
    for bad in ([], [1, "a"], [[1], []], {"a": 1}, 5, [True, 1]):
        assert refused(completion, tok, prompt=bad).param == "prompt"
    assert refused(completion, tok, prompt=[[1], [49152]]).param == "prompt[1]"
    assert refused(completion, tok, prompt=["a"] * 5).message.startswith("prompt: 5 prompts")
    error = refused(completion, tok, prompt=list(range(128)))
    assert error.param == "prompt" and "fills the context of 128 tokens" in error.message


def test_sampling_fields_map_onto_sampling_params(tok):
    params = completion(
        tok,
        prompt="x",
        temperature=0.5,
        top_p=0.9,
        n=2,
        stop="\n",
        seed=3,
        top_k=7,
        min_p=0.1,
        ignore_eos=True,
        logprobs=2,
        stop_token_ids=[9],
        skip_special_tokens=False,
    ).params
    assert (
        params.temperature,
        params.top_p,
        params.n,
        params.stop,
        params.seed,
        params.top_k,
        params.min_p,
        params.ignore_eos,
        params.logprobs,
        params.stop_token_ids,
        params.skip_special_tokens,
    ) == (0.5, 0.9, 2, ("\n",), 3, 7, 0.1, True, 2, (9,), False)
    assert completion(tok, prompt="x").params.max_tokens == 16  # OpenAI's completions default
    assert completion(tok, prompt="x", stop=["a", "b"]).params.stop == ("a", "b")
    penalized = completion(
        tok, PENALTIES_ON, prompt="x", presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2
    ).params
    assert (penalized.presence_penalty, penalized.frequency_penalty, penalized.repetition_penalty) == (0.5, -0.5, 1.2)
    prompt_len = len(chat(tok).prompts[0])
    assert chat(tok).params.max_tokens == 128 - prompt_len  # chat: whatever the context leaves
    assert chat(tok, max_tokens=5).params.max_tokens == 5
    assert chat(tok, max_tokens=5, max_completion_tokens=7).params.max_tokens == 7
    assert chat(tok).params.logprobs is None
    assert chat(tok, logprobs=True).params.logprobs == 0
    assert chat(tok, logprobs=True, top_logprobs=4).params.logprobs == 4


def test_chat_uses_the_chat_template(tok):
    ids = chat(tok).prompts[0]
    assert ids == tok.encode(tok.apply_chat_template(USER, add_generation_prompt=True), add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert chat(tok, messages=parts).prompts == [ids]
    no_prompt = chat(tok, add_generation_prompt=False).prompts[0]
    assert not tok.decode(no_prompt, skip_special_tokens=False).endswith("assistant\n")


@pytest.mark.parametrize(
    "body,param,words",
    [
        (dict(temperature=-1), "temperature", "temperature=-1"),
        (dict(top_p=2), "top_p", "(0, 1]"),
        (dict(n=9), "n", "max_n=4"),
        (dict(max_tokens=0), "max_tokens", ">= 1"),
        (dict(max_completion_tokens=500), "max_completion_tokens", "max_model_len=128"),
        (dict(logprobs=True, top_logprobs=21), "top_logprobs", "[0, 20]"),
        (dict(top_logprobs=2), "top_logprobs", "needs logprobs=true"),
        (dict(stop=["ok", 3]), "stop", "strings"),
        (dict(presence_penalty=0.5), "presence_penalty", "--no-penalties"),
        (
            dict(logit_bias={"50256": -100}),
            "logit_bias",
            "logit_bias[50256]: token ids out of the vocabulary [0, 49152)",
        ),
        (dict(logit_bias={"abc": 1}), "logit_bias", "logit_bias['abc']: keys must be token ids"),
        (dict(logit_bias={"1.5": 1}), "logit_bias", "keys must be token ids"),
        (dict(logit_bias={"-2": 1}), "logit_bias", "logit_bias[-2]: a token id must be an integer >= 0"),
        (dict(logit_bias={"5": 100.5}), "logit_bias", "logit_bias[5]=100.5: must be a number in [-100, 100]"),
        (dict(logit_bias={str(i): 1 for i in range(301)}), "logit_bias", "301 tokens; at most 300"),
        (dict(response_format={"type": "json_schema", "json_schema": {}}), "response_format", "schema: required"),
        (dict(response_format={"type": "xml"}), "response_format", "unknown"),
        (dict(guided_regex="a+", guided_choice=["a"]), "guided_regex", "only one of guided_choice, guided_regex"),
        (dict(guided_choice=[]), "guided_choice", "non-empty list"),
        (dict(stream_options={"include_usage": True}), "stream_options", "stream=true"),
        (dict(tools=[{"type": "function"}]), "tools[0].function", "required"),
        (dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tool_choice", "--tool-call-parser"),
        (dict(messages=[]), "messages", "empty"),
        (dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages[0].content[0].type", "text"),
    ],
)
def test_chat_errors_name_the_request_field(tok, body, param, words):
    error = refused(chat, tok, **body)
    assert error.param == param and error.message.startswith(param) and words in error.message, error.message
    assert error.body()["error"] == {
        "message": error.message,
        "type": "invalid_request_error",
        "param": param,
        "code": None,
    }


def test_logit_bias_keys_become_token_ids(tok):
    body = {"logit_bias": {"5": 2, "49151": -100, "7": 0.5}}
    want = {5: 2.0, 49151: -100.0, 7: 0.5}
    assert completion(tok, prompt="x", **body).params.logit_bias == want
    assert chat(tok, **body).params.logit_bias == want
    assert chat(tok).params.logit_bias is None and chat(tok, logit_bias=None).params.logit_bias is None


def test_completion_only_errors(tok):
    assert refused(completion, tok, prompt="x", logprobs=21).param == "logprobs"
    assert refused(completion, tok, prompt="x", suffix="end").param == "suffix"
    assert refused(completion, tok, prompt="x", best_of=3).param == "best_of"
    error = refused(completion, tok, prompt="x", echo=True, logprobs=1)  # the server lacks prompt logprobs
    assert error.param == "echo" and "--enable-prompt-logprobs" in error.message
    assert refused(completion, tok, prompt="x", prompt_logprobs=1).param == "prompt_logprobs"
    assert refused(chat, tok, prompt_logprobs=0).message.startswith("prompt_logprobs=0: prompt logprobs are off")
    assert refused(completion, None, prompt="text").message.startswith("prompt: this model has no tokenizer")
    assert refused(chat, None).message.startswith("messages: this model has no tokenizer")
    assert completion(tok, prompt="x", response_format={"type": "text"}, logit_bias={}).params.max_tokens == 16


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": USER}, "model"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"model": "m", "messages": USER, "temperature": "hot"}, "temperature"),
        ({"model": "m", "messages": USER, "logit_bias": {"5": "much"}}, "logit_bias"),
        ({"model": "m", "messages": USER, "logit_bias": [5]}, "logit_bias"),
        ({"model": "m", "messages": [{"content": "x"}]}, "messages[0].role"),
    ],
)
def test_validation_errors_name_the_field(body, param):
    with pytest.raises(pydantic.ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    error = from_validation(info.value)
    assert error.status == 400 and error.param == param and error.message.startswith(param), error.message


def _output(text, token_ids, finish=None, logprobs=None, index=0, completion_tokens=1):
    return RequestOutput(
        "r",
        None,
        [1, 2, 3],
        [CompletionOutput(index, text, token_ids, logprobs, finish)],
        finish is not None,
        Usage(3, completion_tokens, 2),
        RequestMetrics(0.0),
    )


def test_chat_chunks_role_content_finish_usage():
    head = outputs.ResponseHeader("chatcmpl-1", "chat.completion.chunk", 7, "m")
    writer = outputs.ChunkWriter(head, 1, outputs.TokenTexts(None), include_usage=True)
    chunks = writer.opening(1)
    lp = Logprob(5, -0.5, {5: -0.5, 6: -1.5})
    chunks += writer.deltas(0, _output("Hel", [5], logprobs=[lp]))
    last = _output("lo", [6], finish="stop", logprobs=[], completion_tokens=2)
    chunks += writer.deltas(0, last) + writer.deltas(0, last)  # a finished choice says so once
    chunks += writer.closing([last])
    assert [c["choices"][0]["delta"] if c["choices"] else None for c in chunks] == [
        {"role": "assistant", "content": ""},
        {"content": "Hel"},
        {"content": "lo"},
        {},
        None,
    ]
    assert [c["choices"][0]["finish_reason"] if c["choices"] else "-" for c in chunks] == [
        None,
        None,
        None,
        "stop",
        "-",
    ]
    assert chunks[1]["choices"][0]["logprobs"]["content"][0] == {
        "token": "token_id:5",
        "logprob": -0.5,
        "bytes": list(b"token_id:5"),
        "top_logprobs": [
            {"token": "token_id:5", "logprob": -0.5, "bytes": list(b"token_id:5")},
            {"token": "token_id:6", "logprob": -1.5, "bytes": list(b"token_id:6")},
        ],
    }
    assert all(c["id"] == "chatcmpl-1" and c["created"] == 7 and c["object"] == "chat.completion.chunk" for c in chunks)
    assert [c["usage"] for c in chunks[:-1]] == [None] * 4
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 2, "host_cached_tokens": 0},
    }


def test_completion_response_indices_echo_and_offsets(tok):
    head = outputs.ResponseHeader("cmpl-1", "text_completion", 7, "m")
    ids = tok.encode(" big cat")
    lps = [Logprob(t, -float(i), {t: -float(i)}) for i, t in enumerate(ids)]
    results = [_output(" big cat", ids, "length", lps), _output("!", [0], "stop", None)]
    body = outputs.completion_response(head, results, 1, outputs.TokenTexts(tok), echo=["A", "B"])
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "A big cat", "length"),
        (1, "B!", "stop"),
    ]
    logprobs = body["choices"][0]["logprobs"]
    assert "".join(logprobs["tokens"]) == " big cat" and logprobs["text_offset"] == [1, 5]
    assert body["usage"]["prompt_tokens"] == 6 and body["object"] == "text_completion"
    assert body["choices"][1]["logprobs"] is None


def test_sse_event_framing():
    assert sse.event({"a": "x\ny", "b": "é"}) == 'data: {"a":"x\\ny","b":"é"}\n\n'.encode()
    assert sse.DONE == b"data: [DONE]\n\n"
    assert json.loads(sse.event({"k": [1, 2]})[6:]) == {"k": [1, 2]}


def test_api_keys(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# team A\nsk-a  # laptop\n\n  sk-b\n")
    assert read_api_keys(str(path)) == ["sk-a", "sk-b"]
    assert read_api_keys(str(path), "sk-c, sk-d") == ["sk-a", "sk-b", "sk-c", "sk-d"]
    assert read_api_keys() == []
    path.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no API key"):
        read_api_keys(str(path))
    keys = APIKeys(["sk-a", "sk-b"])
    assert keys.check("Bearer sk-b") == (True, key_id("sk-b"))
    assert keys.check("bearer sk-a") == (True, key_id("sk-a"))
    assert keys.check("Bearer sk-c") == (False, key_id("sk-c"))
    assert keys.check("sk-a") == (False, None) and keys.check(None) == (False, None)
    assert key_id("sk-a") == "a4a6d307" and len(key_id("anything")) == 8  # sha256("sk-a")[:8]


def test_served_model_name():
    assert served_model_name("/ckpt/llama-1b/") == "llama-1b"
    assert served_model_name("/m/model.Q4.gguf") == "model.Q4"
    assert served_model_name("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
    assert served_model_name("gs://bucket/llama-70b") == "llama-70b"


def test_structured_output_fields_become_the_spec(tok):
    import dataclasses

    from jaxinfer.sampling import StructuredOutput
    from jaxinfer.structured import GrammarBackend

    limits = dataclasses.replace(LIMITS, grammars=GrammarBackend(tok, 49152))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert chat(tok, limits, response_format=fmt).params.structured_output == StructuredOutput(json=schema)
    assert chat(tok, limits, response_format={"type": "json_object"}).params.structured_output.json_object
    assert chat(tok, limits, response_format={"type": "text"}).params.structured_output is None
    assert completion(tok, limits, prompt="x", guided_regex="[0-9]+").params.structured_output.regex == "[0-9]+"
    assert completion(tok, limits, prompt="x", guided_choice=["a", "b"]).params.structured_output.choice == ("a", "b")
    assert completion(tok, limits, prompt="x", guided_json=json.dumps(schema)).params.structured_output.json == schema
    assert chat(tok, limits, guided_grammar='start: "x"').params.structured_output.grammar == 'start: "x"'
    # compiled on the caller's (worker) thread: a bad pattern is a 400 naming the request's field
    error = refused(chat, tok, limits, guided_regex="(open")
    assert error.param == "guided_regex" and error.message.startswith("guided_regex: regex:"), error.message
    error = refused(
        chat, tok, limits, response_format={"type": "json_schema", "json_schema": {"schema": {"type": "no-such-type"}}}
    )
    assert error.param == "response_format" and "json" in error.message
    assert refused(chat, tok, LIMITS, guided_regex="a").message.endswith("no tokenizer to constrain")


PROMPT_LOGPROBS_ON = ModelLimits(
    vocab_size=49152, max_model_len=128, penalties_enabled=False, max_n=4, prompt_logprobs_enabled=True
)


def test_prompt_logprobs_requests(tok):
    """echo with logprobs=N asks the engine for the prompt's N (or prompt_logprobs, if more);
    prompt_logprobs alone asks for vLLM's field; bad values name the request's field."""
    echo = completion(tok, PROMPT_LOGPROBS_ON, prompt="x", echo=True, logprobs=2)
    assert (echo.params.prompt_logprobs, echo.echo_top, echo.prompt_logprobs_field) == (2, 2, False)
    both = completion(tok, PROMPT_LOGPROBS_ON, prompt="x", echo=True, logprobs=1, prompt_logprobs=4)
    assert (both.params.prompt_logprobs, both.echo_top, both.prompt_logprobs_field) == (4, 1, True)
    assert completion(tok, PROMPT_LOGPROBS_ON, prompt="x", logprobs=1).params.prompt_logprobs is None
    assert chat(tok, PROMPT_LOGPROBS_ON, prompt_logprobs=0).prompt_logprobs_field
    assert refused(completion, tok, PROMPT_LOGPROBS_ON, prompt="x", prompt_logprobs=21).param == "prompt_logprobs"
    assert refused(completion, tok, PROMPT_LOGPROBS_ON, prompt="x", echo=True, logprobs=21).param == "logprobs"


def _scored(prompt_ids, logprobs, completion_output):
    scored = [None] + [Logprob(t, lp, {t: lp, 99: lp - 1.0}, 1) for t, lp in zip(prompt_ids[1:], logprobs)]
    return RequestOutput(
        "r", None, prompt_ids, [completion_output], True, Usage(len(prompt_ids), 1), RequestMetrics(0.0), scored
    )


def test_echoed_prompt_logprobs_and_the_field(tok):
    """The echoed prompt's tokens lead the legacy logprobs (the first with none) with offsets
    from 0; the field lists each position's tokens with ranks; streamed, both come with the
    echo chunk, once."""
    ids, (bang,) = tok.encode("A big cat"), tok.encode("!")
    out = _scored(ids, [-1.0, -2.0], CompletionOutput(0, "!", [bang], [Logprob(bang, -0.5, {bang: -0.5})], "stop"))
    texts = outputs.TokenTexts(tok)
    shown = outputs.PromptShown(echo_top=1, field=True)
    head = outputs.ResponseHeader("cmpl-1", "text_completion", 7, "m")
    choice = outputs.completion_response(head, [out], 1, texts, echo=["A big cat"], shown=shown)["choices"][0]
    lps = choice["logprobs"]
    assert lps["tokens"] == ["A", " big", " cat", "!"] and lps["token_logprobs"] == [None, -1.0, -2.0, -0.5]
    assert lps["top_logprobs"] == [None, {" big": -1.0}, {" cat": -2.0}, {"!": -0.5}]  # echo_top=1
    assert lps["text_offset"] == [0, 1, 5, 9] and choice["text"] == "A big cat!"
    assert choice["prompt_logprobs"] == [None] + [
        {
            str(t): {"logprob": lp, "rank": 1, "decoded_token": tok.decode([t])},
            "99": {"logprob": lp - 1.0, "rank": 2, "decoded_token": tok.decode([99])},
        }
        for t, lp in zip(ids[1:], [-1.0, -2.0])
    ]
    writer = outputs.ChunkWriter(head, 1, texts, include_usage=False, echo=["A big cat"], shown=shown)
    assert writer.opening(1) == []  # the echo waits for the prompt's logprobs
    chunks = writer.deltas(0, out)
    assert [c["choices"][0]["text"] for c in chunks] == ["A big cat", "!", ""]
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"] == [None, -1.0, -2.0]
    assert chunks[0]["choices"][0]["prompt_logprobs"] == choice["prompt_logprobs"]
    assert chunks[1]["choices"][0]["logprobs"]["text_offset"] == [9]
    chat_head = outputs.ResponseHeader("chatcmpl-1", "chat.completion", 7, "m")
    body = outputs.chat_response(chat_head, out, texts, shown=outputs.PromptShown(field=True))
    assert body["prompt_logprobs"] == choice["prompt_logprobs"] and "prompt_logprobs" not in body["choices"][0]
    assert "prompt_logprobs" not in outputs.chat_response(chat_head, out, texts)


def test_echo_with_max_tokens_0_scores_the_prompt_alone(tok):
    """echo with max_tokens 0 (vLLM's pure scoring): the engine computes the prompt and generates
    nothing (SamplingParams.max_tokens=0, so the prompt may fill the context); the choice is the
    prompt with its logprobs, ending for length, 0 completion tokens. Without echo, max_tokens 0
    is refused by name."""
    scoring = completion(tok, PROMPT_LOGPROBS_ON, prompt="x", echo=True, logprobs=1, max_tokens=0)
    assert scoring.params.max_tokens == 0 and scoring.params.prompt_logprobs == 1
    full = completion(tok, PROMPT_LOGPROBS_ON, prompt=list(range(128)), echo=True, logprobs=1, max_tokens=0)
    assert full.prompts == [list(range(128))]  # the whole context of 128: nothing is generated
    assert refused(completion, tok, PROMPT_LOGPROBS_ON, prompt="x", max_tokens=0).param == "max_tokens"
    ids = tok.encode("A big cat")
    scored = [None] + [Logprob(t, lp, {t: lp, 99: lp - 1.0}, 1) for t, lp in zip(ids[1:], [-1.0, -2.0])]
    out = RequestOutput(
        "r",
        None,
        ids,
        [CompletionOutput(0, "", [], [], "length")],
        True,
        Usage(len(ids), 0),
        RequestMetrics(0.0),
        scored,
    )
    texts, shown = outputs.TokenTexts(tok), outputs.PromptShown(echo_top=1)
    head = outputs.ResponseHeader("cmpl-1", "text_completion", 7, "m")
    body = outputs.completion_response(head, [out], 1, texts, echo=["A big cat"], shown=shown)
    (choice,) = body["choices"]
    assert choice["text"] == "A big cat" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["A", " big", " cat"]
    assert choice["logprobs"]["token_logprobs"] == [None, -1.0, -2.0] and body["usage"]["completion_tokens"] == 0
    writer = outputs.ChunkWriter(head, 1, texts, include_usage=False, echo=["A big cat"], shown=shown)
    chunks = writer.deltas(0, out)
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks] == [
        ("A big cat", None),
        ("", "length"),
    ]
