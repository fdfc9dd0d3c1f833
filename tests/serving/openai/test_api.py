"""The OpenAI-compatible HTTP API of a real `jaxinfer serve` process (the embedded SmolLM2, gRPC
on too) driven by the official `openai` client and by raw HTTP: chat and completions streamed or
not, n, stop, seeds, logprobs, errors with their status and field, SSE framing byte for byte,
models / health / metrics / tokenize / detokenize, disconnects that free the KV pages, gRPC
beside HTTP on the same engine, tool calling over both (named and required choices constrained
to valid calls, hermes-format calls read out of the text whole and streamed), and reasoning
split off as reasoning_content (the server reads qwen3's <think>; SmolLM2 writes none unless
its output is forced to), and prompt logprobs (echo with logprobs, vLLM's prompt_logprobs field,
gRPC)."""

import json
import re
import socket
import time

import grpc
import jsonschema
import openai
import pytest
from openai_support import ServedProcess, metric, raw_request, wait_for
from testpaths import SMOLLM2_SMALL_ARGS

from jaxinfer.cli import main
from serving.grpc.client import Client
from serving.grpc.proto import jaxinfer_pb2 as pb

MODEL = "SmolLM2-135M-Instruct"
KEYS = ("sk-first-key", "sk-second-key")
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
# grpc/test_smollm2.py's engine (its step variants are in the run's compilation cache), served.
ARGS = [
    *SMOLLM2_SMALL_ARGS,
    "--no-penalties",
    "--port",
    "0",
    "--http-port",
    "0",
    "--max-body-bytes",
    str(1 << 20),
    "--tool-call-parser",
    "hermes",
    "--reasoning-parser",
    "qwen3",
    "--enable-prompt-logprobs",
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    server = ServedProcess(ARGS, tmp_path_factory.mktemp("serve") / "log", env={"JAXINFER_API_KEYS": ",".join(KEYS)})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.http}/v1", api_key=KEYS[0], max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def grpc_client(served):
    with Client(served.grpc) as c:
        yield c


def test_chat_plain_and_streamed(client):
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32)
    assert plain.id.startswith("chatcmpl-") and plain.object == "chat.completion" and plain.model == MODEL
    assert plain.choices[0].message.role == "assistant" and plain.choices[0].index == 0
    assert plain.choices[0].message.content == "The capital of France is Paris."  # the chat template is used
    assert plain.choices[0].finish_reason == "stop" and plain.choices[0].logprobs is None
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            temperature=0,
            max_tokens=32,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant" and not chunks[0].choices[0].delta.content
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 2) + ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def test_stop_and_max_completion_tokens(client):
    stopped = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, stop=["Paris"])
    assert stopped.choices[0].message.content == "The capital of France is "
    assert stopped.choices[0].finish_reason == "stop"
    short = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_completion_tokens=3)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    streamed = list(
        client.completions.create(
            model=MODEL, prompt="One, two, three,", temperature=0, max_tokens=12, stop=" five", stream=True
        )
    )
    text = "".join(c.choices[0].text for c in streamed)
    assert text == " four," and streamed[-1].choices[0].finish_reason == "stop"


def test_completions_n2_and_seed_reproducibility(client):
    def sample(seed):
        return client.completions.create(
            model=MODEL, prompt="Once upon a time", n=2, temperature=1.0, seed=seed, max_tokens=8
        )

    first, again = sample(1234), sample(1234)
    assert first.id.startswith("cmpl-") and first.object == "text_completion"
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert all(c.text for c in first.choices) and first.usage.completion_tokens == 16
    batch = client.completions.create(
        model=MODEL, prompt=[[19556], [504, 3479]], n=2, temperature=0, max_tokens=4, echo=True
    )  # token-id prompts: "Hello", "The ..."
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text.startswith("Hello") and batch.choices[2].text.startswith("The")
    assert batch.choices[0].text == batch.choices[1].text  # greedy: both samples agree


def test_logprobs(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 6 and "".join(t.token for t in content) == chat.choices[0].message.content
    for t in content:  # greedy: the chosen token is the most likely one
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob) and t.bytes == list(t.token.encode())
    done = client.completions.create(
        model=MODEL, prompt="The three primary colors are", temperature=0, max_tokens=5, logprobs=2
    )
    lp = done.choices[0].logprobs
    assert "".join(lp.tokens) == done.choices[0].text and len(lp.token_logprobs) == 5
    assert all(
        len(top) == 2 and max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs, lp.token_logprobs)
    )
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]


def test_prompt_logprobs_over_echo_the_field_and_grpc(client, grpc_client):
    """Completions' echo with logprobs=N leads each choice's logprobs with the prompt's tokens (the
    first has none), whole and streamed; vLLM's prompt_logprobs field gives the same values with
    ranks, in completions' choices and at the top of a chat; gRPC too."""
    prompt = "The three primary colors are"
    ids = grpc_client.tokenize(prompt)
    done = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=2, temperature=0)
    choice, lp = done.choices[0], done.choices[0].logprobs
    assert choice.text.startswith(prompt) and len(lp.tokens) == len(ids) + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and "".join(lp.tokens[: len(ids)]) == prompt
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(0 < len(t) <= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    field = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    entries = field.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None and field.choices[0].logprobs is None
    for i, entry in enumerate(entries[1:], start=1):
        own = entry[str(ids[i])]
        assert own["logprob"] == pytest.approx(lp.token_logprobs[i], abs=1e-4) and own["rank"] >= 1
        assert own["decoded_token"] == lp.tokens[i] and len(entry) in (1, 2)
        assert any(e["rank"] == 1 for e in entry.values())
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=2, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].text == prompt and chunks[0].choices[0].logprobs.tokens == lp.tokens[: len(ids)]
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert sum((c.choices[0].logprobs.token_logprobs for c in chunks if c.choices[0].logprobs), []) == pytest.approx(
        lp.token_logprobs, abs=1e-4
    )  # None == None; the rest to float noise
    chat = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens
    streamed = [
        c
        for c in client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=1, stream=True, extra_body={"prompt_logprobs": 0}
        )
        if (c.model_extra or {}).get("prompt_logprobs")
    ]
    assert len(streamed) == 1 and streamed[0].model_extra["prompt_logprobs"] == chat.model_extra["prompt_logprobs"]
    assert grpc_client.model_info().prompt_logprobs_enabled
    result = grpc_client.generate(prompt, max_tokens=1, temperature=0, prompt_logprobs=2)
    assert [x.token_id for x in result.prompt_logprobs] == ids[1:]
    assert [x.logprob for x in result.prompt_logprobs] == pytest.approx(lp.token_logprobs[1 : len(ids)], abs=1e-4)
    assert all(x.rank >= 1 and len(x.top) == 2 for x in result.prompt_logprobs)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=prompt, extra_body={"prompt_logprobs": 21})
    assert info.value.body["param"] == "prompt_logprobs"


def test_echo_with_max_tokens_0_scores_prompts_alone(client, grpc_client):
    """lm-eval's loglikelihood request (echo, logprobs, max_tokens 0): each prompt comes back with
    its logprobs and nothing generated, whole and streamed; the values are the ones a request
    that also generates gets for its prompt."""
    prompts = ["The three primary colors are red, yellow and blue", "Paris"]
    scored = client.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=0)
    generating = client.completions.create(
        model=MODEL, prompt=prompts[0], echo=True, logprobs=1, max_tokens=3, temperature=0
    )
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == sum(
        len(grpc_client.tokenize(p)) for p in prompts
    )
    for choice, prompt in zip(scored.choices, prompts):
        lp = choice.logprobs
        assert choice.text == prompt and choice.finish_reason == "length"
        assert len(lp.tokens) == len(grpc_client.tokenize(prompt)) and lp.token_logprobs[0] is None
    n = len(scored.choices[0].logprobs.tokens)
    assert scored.choices[0].logprobs.token_logprobs == pytest.approx(
        generating.choices[0].logprobs.token_logprobs[:n], abs=1e-4
    )
    chunks = list(
        client.completions.create(model=MODEL, prompt=prompts[0], echo=True, logprobs=1, max_tokens=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == prompts[0]
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=0)
    assert info.value.body["param"] == "max_tokens"


def test_errors_have_openai_shape_and_status(client, served):
    with pytest.raises(openai.AuthenticationError) as info:
        openai.OpenAI(base_url=f"{served.http}/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    other = openai.OpenAI(base_url=f"{served.http}/v1", api_key=KEYS[1], max_retries=0)
    assert [m.id for m in other.models.list().data] == [MODEL]  # every listed key works
    status, _, body = raw_request(served, "GET", "/v1/models")
    assert status == 401 and json.loads(body)["error"]["message"].startswith("missing API key")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=-1)
    assert info.value.body["param"] == "temperature" and "temperature" in info.value.body["message"]
    for kwargs, param in (
        (dict(presence_penalty=0.5), "presence_penalty"),
        (dict(logit_bias={"abc": 1}), "logit_bias"),
        (dict(response_format={"type": "xml"}), "response_format"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=QUESTION, **kwargs)
        assert info.value.body["param"] == param, info.value.body
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="Hi")
    assert info.value.body["code"] == "model_not_found" and MODEL in info.value.body["message"]
    status, _, body = raw_request(served, "GET", "/v1/nothing-here", key=KEYS[0])
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found"
    status, _, body = raw_request(served, "POST", "/v1/completions", b"{not json", key=KEYS[0])
    assert status == 400 and "not valid JSON" in json.loads(body)["error"]["message"]
    status, _, body = raw_request(served, "POST", "/v1/chat/completions", b"[" * 200_000 + b"]" * 200_000, key=KEYS[0])
    assert status == 400 and "nested too deeply" in json.loads(body)["error"]["message"]


def test_logit_bias_forces_and_bans_tokens(client, grpc_client):
    paris = grpc_client.tokenize(" Paris")[-1]
    forced = grpc_client.detokenize([paris] * 4)
    for sampling in (dict(temperature=0), dict(temperature=1.0, seed=7)):  # greedy rows see the bias too
        out = client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=4,
            logit_bias={str(paris): 100},
            extra_body={"ignore_eos": True},
            **sampling,
        )
        assert out.choices[0].text == forced, sampling
    chat = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=4, temperature=0, logit_bias={str(paris): 100}
    )
    assert chat.choices[0].message.content == forced
    greedy = grpc_client.generate("Once upon a time", max_tokens=1, temperature=0, timeout=120).token_ids[0]
    banned = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=1, temperature=0, logit_bias={str(greedy): -100}
    )
    assert banned.choices[0].text != grpc_client.detokenize([greedy])
    over_grpc = grpc_client.generate(
        "Once upon a time", max_tokens=1, temperature=0, timeout=120, logit_bias={greedy: -100}
    )
    assert over_grpc.text == banned.choices[0].text and over_grpc.token_ids[0] != greedy
    for bias, words in (
        ({"abc": 1}, "logit_bias['abc']: keys must be token ids"),
        ({"49152": 1}, "logit_bias[49152]: token ids out of the vocabulary [0, 49152)"),
        ({str(paris): 101}, f"logit_bias[{paris}]=101.0: must be a number in [-100, 100]"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, logit_bias=bias)
        assert info.value.body["param"] == "logit_bias" and info.value.body["message"].startswith(words), (
            info.value.body
        )


def test_oversized_bodies_get_413(client, served):
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=MODEL, prompt="x" * (1 << 20))
    assert info.value.status_code == 413 and info.value.body["code"] == "request_too_large"
    chunks = (b" " * 65536 for _ in range(17))  # chunked: no Content-Length, counted while read
    status, _, body = raw_request(served, "POST", "/v1/completions", chunks, key=KEYS[0])
    assert status == 413 and "limit of 1048576 bytes" in json.loads(body)["error"]["message"]


def test_sse_framing_byte_for_byte(served):
    request = {
        "model": MODEL,
        "messages": QUESTION,
        "temperature": 0,
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    status, headers, body = raw_request(served, "POST", "/v1/chat/completions", request, key=KEYS[0])
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert body.endswith(b"\n\ndata: [DONE]\n\n")
    events = body.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    assert all(e.startswith(b"data: {") and b"\n" not in e for e in events[:-2])
    chunks = [json.loads(e[len(b"data: ") :]) for e in events[:-2]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert (
        body
        == b"".join(
            b"data: " + json.dumps(c, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n" for c in chunks
        )
        + b"data: [DONE]\n\n"
    )


def test_models_health_metrics_tokenize(client, served, grpc_client):
    models = client.models.list().data
    assert [(m.id, m.object, m.owned_by) for m in models] == [(MODEL, "model", "jaxinfer")]
    assert client.models.retrieve(MODEL).id == MODEL
    assert raw_request(served, "GET", "/health")[0] == 200  # open: no key
    status, headers, body = raw_request(served, "GET", "/metrics")
    text = body.decode()
    for name in (
        "jaxinfer_generation_tokens_total",
        "jaxinfer_time_to_first_token_seconds_bucket",
        "jaxinfer_kv_cache_free_pages",
        'jaxinfer_http_requests_total{route="/v1/chat/completions"',
    ):
        assert name in text
    status, _, body = raw_request(served, "POST", "/tokenize", {"model": MODEL, "prompt": "Hello, world!"}, key=KEYS[0])
    tokens = json.loads(body)
    assert status == 200 and tokens["tokens"] == grpc_client.tokenize("Hello, world!")
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    status, _, body = raw_request(served, "POST", "/detokenize", {"tokens": tokens["tokens"]}, key=KEYS[0])
    assert status == 200 and json.loads(body) == {"prompt": "Hello, world!"}
    status, _, body = raw_request(served, "POST", "/tokenize", {"messages": QUESTION}, key=KEYS[0])
    prompt_tokens = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1).usage.prompt_tokens
    assert json.loads(body)["count"] == prompt_tokens == len(grpc_client.tokenize(messages=QUESTION))


def test_what_routers_read(client, served, grpc_client):
    """/get_load, /load, /get_server_info, /kv_event_sources (open), the renders (keyed) and the
    vllm:* metrics, read back against the engine's own counters."""
    for path, want in (("/get_load", "load"), ("/load", "server_load"), ("/get_server_info", "kv_block_size")):
        status, _, body = raw_request(served, "GET", path)
        assert status == 200 and want in json.loads(body)
    assert json.loads(raw_request(served, "GET", "/get_load")[2])["load"] == 0  # nothing in flight
    info = json.loads(raw_request(served, "GET", "/get_server_info")[2])
    assert info["model_id"] == MODEL and info["kv_block_size"] == 16 and info["kv_events"] is False
    assert json.loads(raw_request(served, "GET", "/kv_event_sources")[2]) == {}  # not publishing
    status, _, body = raw_request(served, "POST", "/v1/chat/completions/render", {"model": MODEL, "messages": QUESTION})
    assert status == 401  # the renders take the key like the routes they render for
    status, _, body = raw_request(
        served, "POST", "/v1/chat/completions/render", {"model": MODEL, "messages": QUESTION}, key=KEYS[0]
    )
    assert status == 200 and json.loads(body)["token_ids"] == grpc_client.tokenize(messages=QUESTION)
    body = {"model": MODEL, "prompt": ["Hello, world!", "Bye"]}
    status, _, rendered = raw_request(served, "POST", "/v1/completions/render", body, key=KEYS[0])
    assert [r["token_ids"] for r in json.loads(rendered)] == [grpc_client.tokenize(p) for p in body["prompt"]]
    client.completions.create(model=MODEL, prompt="Hello, world!", max_tokens=2)
    labels = f'engine="0",model_name="{MODEL}"'
    for ours, theirs in (
        ("jaxinfer_prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
        ("jaxinfer_prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
        ("jaxinfer_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc"),
        ("jaxinfer_kv_cache_usage_ratio", "vllm:gpu_cache_usage_perc"),
        ("jaxinfer_num_requests_running", "vllm:num_requests_running"),
    ):
        assert metric(served, theirs, labels) == metric(served, ours), theirs
    assert metric(served, "vllm:prefix_cache_queries_total", labels) > 0
    text = raw_request(served, "GET", "/metrics")[2].decode()
    assert f'vllm:cache_config_info{{block_size="16",cache_dtype="auto",enable_prefix_caching="True",{labels}' in text


def test_grpc_beside_http_on_one_engine(client, grpc_client):
    over_grpc = grpc_client.generate("Once upon a time", max_tokens=8, temperature=0, ignore_eos=True, timeout=120)
    over_http = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert over_http.choices[0].text == over_grpc.text and over_http.usage.completion_tokens == 8
    assert grpc_client.health() == "SERVING"


def _open_request(served, body: dict) -> socket.socket:
    sock = socket.create_connection((served.host, int(served.port)), timeout=60)
    data = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + KEYS[0].encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(data) + data
    )
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_pages(served, grpc_client, stream):
    aborted = metric(served, "jaxinfer_requests_total", 'finish_reason="abort"')
    sock = _open_request(
        served, {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": stream}
    )
    if stream:
        assert b"data: {" in sock.recv(65536) + sock.recv(65536)  # headers, then the first chunk
    stats = wait_for(lambda: (s := grpc_client.server_stats()).running == 1 and s)
    assert stats.kv_pages_free < stats.kv_pages_total  # the request holds pages now
    sock.close()  # 400 tokens take ~30 s: only an abort ends it within the wait below
    started = time.monotonic()
    wait_for(lambda: metric(served, "jaxinfer_requests_total", 'finish_reason="abort"') == aborted + 1, timeout=10)
    stats = wait_for(lambda: (s := grpc_client.server_stats()).running == 0 and s, timeout=10)
    assert stats.waiting == 0 and stats.kv_pages_free == stats.kv_pages_total
    assert time.monotonic() - started < 10


# --- structured output (HTTP and gRPC) ------------------------------------------------------------
SCHEMAS = {
    "person": {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "age"],
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
    },
    "list": {
        "type": "object",
        "additionalProperties": False,
        "required": ["items", "kind"],
        "properties": {
            "items": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3},
            "kind": {"enum": ["fruit", "tool", "animal"]},
        },
    },
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_strict_json_schema_reply_validates(client, name):
    schema = SCHEMAS[name]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Reply in JSON."}],
        max_tokens=120,
        temperature=0.7,
        seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


def test_json_object_regex_and_choice_over_http(client):
    obj = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=60, temperature=0, response_format={"type": "json_object"}
    )
    assert obj.choices[0].message.content.startswith("{")
    regex = client.completions.create(
        model=MODEL,
        prompt="The code is",
        max_tokens=12,
        temperature=0.5,
        seed=1,
        extra_body={"guided_regex": r"[A-Z]{3}-[0-9]{2}"},
    )
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", regex.choices[0].text)
    choice = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=8, temperature=0, extra_body={"guided_choice": ["Paris", "Rome"]}
    )
    assert choice.choices[0].message.content == "Paris"


def test_bad_structured_requests_name_the_field(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=QUESTION, extra_body={"guided_regex": ""})
    assert err.value.body["param"] == "guided_regex"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=QUESTION, response_format={"type": "json_schema"})
    assert "response_format.json_schema.schema" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=QUESTION, extra_body={"guided_regex": "(open"})
    assert err.value.body["param"] == "guided_regex" and "regex" in err.value.body["message"]


def test_structured_output_over_grpc(grpc_client):
    out = grpc_client.generate(
        messages=QUESTION,
        max_tokens=60,
        temperature=0,
        timeout=120,
        structured_output=pb.StructuredOutput(json_schema=json.dumps(SCHEMAS["person"])),
    )
    jsonschema.validate(json.loads(out.text), SCHEMAS["person"])
    choice = grpc_client.generate(
        messages=QUESTION,
        max_tokens=8,
        temperature=0,
        timeout=120,
        structured_output=pb.StructuredOutput(choice=pb.StructuredOutput.Choices(choices=["Paris", "Rome"])),
    )
    assert choice.text == "Paris"
    with pytest.raises(grpc.RpcError) as err:
        grpc_client.generate("Hi", max_tokens=4, timeout=60, structured_output=pb.StructuredOutput(regex="(open"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("sampling.structured_output: regex:"), err.value.details()


# --- tool calling (the server reads hermes-format calls: --tool-call-parser) -----------------
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>'


def create_with_tools(client, **kwargs):
    kwargs = {"messages": ASK, "temperature": 0, "max_tokens": 60, "tools": [WEATHER, TIME], **kwargs}
    return client.chat.completions.create(model=MODEL, **kwargs)


def streamed(client, **kwargs) -> tuple[str, dict, str]:
    """(content, {index: call with its arguments joined}, finish_reason) of a streamed choice."""
    content, calls, finish = "", {}, None
    for chunk in create_with_tools(client, stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            call["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def test_a_named_function_gets_valid_arguments(client):
    reply = create_with_tools(client, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    content, calls, finish = streamed(client, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert content == "" and finish == "stop" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == call.function.arguments


def test_required_makes_at_least_one_valid_call(client):
    reply = create_with_tools(client, tool_choice="required", parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    content, calls, finish = streamed(client, tool_choice="required", parallel_tool_calls=False)
    assert finish == "tool_calls" and [(c["name"], c["arguments"]) for c in calls.values()] == [
        (call.function.name, call.function.arguments)
    ]


def test_auto_reads_calls_out_of_the_text(client):
    # the model's text forced to a hermes call: what a tool-tuned model writes
    reply = create_with_tools(client, extra_body={"guided_choice": [f"Let me check.\n{CALL}"]})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {"city": "Oslo"})
    content, calls, finish = streamed(client, extra_body={"guided_choice": [f"Let me check.\n{CALL}"]})
    assert (content, finish) == ("Let me check.", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_time", call.function.arguments)]
    # text that makes no call is the content, unchanged
    plain = create_with_tools(client, extra_body={"guided_choice": ["No <tool_call> needed."]}).choices[0]
    assert plain.message.content == "No <tool_call> needed." and plain.message.tool_calls is None
    assert plain.finish_reason == "stop"


def test_a_conversation_with_a_tool_result(client):
    messages = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18, "sky": "clear"}'},
    ]
    reply = create_with_tools(client, messages=messages, tool_choice="none", max_tokens=16)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content
    plain = create_with_tools(client, messages=messages[:1], tool_choice="none", max_tokens=1)
    assert reply.usage.prompt_tokens > plain.usage.prompt_tokens + 10  # the tool's result is in the prompt
    with pytest.raises(openai.BadRequestError) as info:
        create_with_tools(
            client,
            messages=messages[:2]
            + [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{oops"}}
                    ],
                }
            ],
        )
    assert info.value.body["param"] == "messages[2].tool_calls[0].function.arguments"


def test_grpc_gets_the_same_calls(client, grpc_client):
    assert grpc_client.model_info().tool_call_format == "hermes"  # --tool-call-parser
    named = create_with_tools(client, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    got = grpc_client.generate(
        messages=ASK, tools=[WEATHER, TIME], tool_choice="get_weather", temperature=0, max_tokens=60
    ).outputs[0]
    (call,) = got.tool_calls
    assert call.id.startswith("call_") and call.name == "get_weather" and got.content == ""
    assert call.arguments == named.choices[0].message.tool_calls[0].function.arguments == got.text
    forced = pb.StructuredOutput(choice=pb.StructuredOutput.Choices(choices=[f"Let me check.\n{CALL}"]))
    got = grpc_client.generate(
        messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=60, structured_output=forced
    ).outputs[0]
    assert got.text == f"Let me check.\n{CALL}" and got.content == "Let me check." and got.finish_reason == "stop"
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == [("get_time", {"city": "Oslo"})]
    plain = grpc_client.generate(messages=ASK, temperature=0, max_tokens=4).outputs[0]
    # no tools: no calls; the reasoning parser still reads it (and finds no reasoning)
    assert plain.tool_calls == [] and plain.content == plain.text and plain.reasoning_content is None
    with pytest.raises(grpc.RpcError) as info:
        grpc_client.generate(messages=ASK, tools=[WEATHER], tool_choice="get_wind", max_tokens=4)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("chat.tool_choice.function.name='get_wind': not among the tools")


def test_the_client_command_sends_tools(served, tmp_path, capsys):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER, TIME]))
    argv = [
        "client",
        "--server",
        served.grpc,
        "generate",
        "--chat",
        ASK[0]["content"],
        "--tools",
        str(tools),
        "--tool-choice",
        "get_time",
        "--max-tokens",
        "40",
        "--temperature",
        "0",
        "--output-format",
        "jsonl",
    ]
    assert main(argv) == 0
    last = json.loads(capsys.readouterr().out.splitlines()[-1])
    (call,) = last["outputs"][0]["tool_calls"]
    assert call["name"] == "get_time" and set(json.loads(call["arguments"])) == {"city"}
    assert main([*argv[:6], "--tools", "[oops"]) == 2
    assert "--tools '[oops': neither a file nor a JSON list" in capsys.readouterr().err


def test_reasoning_is_split_off_over_both_transports(client, grpc_client):
    thinking = "<think>\nThe capital of France is Paris.\n</think>\n\nParis."
    forced = {"guided_choice": [thinking]}
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, extra_body=forced)
    message = reply.choices[0].message
    assert (message.reasoning_content, message.content) == ("The capital of France is Paris.", "Paris.")
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, stream=True, extra_body=forced)
    )
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == "Paris."
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32)
    assert plain.choices[0].message.content == "The capital of France is Paris."
    assert plain.choices[0].message.reasoning_content is None  # SmolLM2 does not think
    choice = pb.StructuredOutput(choice=pb.StructuredOutput.Choices(choices=[thinking]))
    got = grpc_client.generate(messages=QUESTION, max_tokens=40, structured_output=choice).outputs[0]
    assert (got.text, got.reasoning_content, got.content) == (thinking, "The capital of France is Paris.", "Paris.")
