"""The HTTP API in process (BackgroundServer, gRPC and HTTP on the tiny fixture's engine, which
has no tokenizer): completions equal LLM.generate token for token, one in-flight limit for both
transports, a server that stops under a request answers 503 / an error event, what a model
without a tokenizer refuses, and TLS with the gRPC token as the API key."""

import http.client
import json
import shutil
import socket
import ssl
import subprocess
import threading
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from serving_support import client_of, slow_steps, wait_for

from jaxinfer.sampling import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 50))]
SETTINGS = [
    dict(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
    dict(temperature=0.9, top_k=50, seed=7, max_tokens=10, ignore_eos=True, logprobs=1),
]


@pytest.fixture(scope="module")
def expected(tiny_llm):
    """LLM.generate's outputs, computed before a server owns the engine."""
    outs = tiny_llm.generate(
        [p for _ in SETTINGS for p in PROMPTS], [SamplingParams(**s) for s in SETTINGS for _ in PROMPTS], use_tqdm=False
    )
    return [o.outputs[0] for o in outs]


def openai_client(server, **kwargs):
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none", max_retries=0, timeout=60, **kwargs
    )


def _ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]  # a model without a tokenizer names ids


def test_completions_equal_llm_generate(serve, expected):
    server = serve(http_port=0)
    client = openai_client(server)
    cases = [(s, p) for s in SETTINGS for p in PROMPTS]
    for (settings, prompt), want in zip(cases, expected):
        fields = dict(settings)
        extra = {name: fields.pop(name) for name in ("ignore_eos", "top_k") if name in fields}
        done = client.completions.create(model="llama3", prompt=prompt, extra_body=extra, **fields)
        choice = done.choices[0]
        assert _ids(choice.logprobs.tokens) == want.token_ids and choice.finish_reason == want.finish_reason
        assert choice.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
        assert done.usage.prompt_tokens == len(prompt) and done.usage.completion_tokens == len(want.token_ids)
        streamed = [
            t
            for c in client.completions.create(model="llama3", prompt=prompt, extra_body=extra, stream=True, **fields)
            if c.choices[0].logprobs
            for t in c.choices[0].logprobs.tokens
        ]
        assert _ids(streamed) == want.token_ids


def test_one_in_flight_limit_for_both_transports(serve):
    server = serve(http_port=0, max_waiting=0)  # 8 running, nothing waiting: 8 in flight at most
    assert server.server.servicer.max_in_flight == 8
    engine = server.server.engine_loop.engine
    client = openai_client(server)
    with slow_steps(engine, 0.05):
        streams = [
            client.completions.create(
                model="llama3", prompt=[1, 2, k], max_tokens=200, stream=True, extra_body={"ignore_eos": True}
            )
            for k in range(8)
        ]
        wait_for(lambda: server.server.http.num_in_flight == 8)
        with client_of(server) as grpc_client:
            with pytest.raises(grpc.RpcError) as info:
                grpc_client.generate([9, 9], max_tokens=2, timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # HTTP's requests count for gRPC
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="llama3", prompt=[9, 9], max_tokens=2)
        assert info.value.status_code == 503 and info.value.body["code"] == "server_busy"
        assert info.value.response.headers["retry-after"] == "1"
        for stream in streams:
            stream.close()  # the client goes away: aborted, pages freed, slots given back
        wait_for(lambda: server.server.http.num_in_flight == 0)
    assert client.completions.create(model="llama3", prompt=[9, 9], max_tokens=2).usage.completion_tokens == 2


def test_requests_cut_by_a_stop_get_503_or_an_error_event(serve):
    server = serve(http_port=0)
    engine = server.server.engine_loop.engine
    client = openai_client(server)
    answers = {}

    def plain():
        try:
            client.completions.create(model="llama3", prompt=[1, 2], max_tokens=200, extra_body={"ignore_eos": True})
        except openai.APIStatusError as e:
            answers["plain"] = (e.status_code, e.body["code"])

    def streamed():
        try:
            chunks = list(
                client.completions.create(
                    model="llama3",
                    prompt=[1, 3],
                    max_tokens=200,
                    stream=True,
                    logprobs=0,
                    extra_body={"ignore_eos": True},
                )
            )
            answers["stream"] = chunks
        except openai.APIError as e:  # the client raises on an error event
            answers["stream"] = e.message

    with slow_steps(engine, 0.05):
        threads = [threading.Thread(target=f) for f in (plain, streamed)]
        for t in threads:
            t.start()
        running = lambda: server.server.engine_loop.call(lambda e: e.stats()["running"]).result(10)  # noqa: E731
        wait_for(lambda: server.server.http.num_in_flight == 2 and running() == 2)
        server.stop(grace=0)
        for t in threads:
            t.join(30)
    assert answers["plain"] == (503, "shutting_down")
    assert "shutting down" in answers["stream"]


def test_a_model_without_tokenizer_refuses_text(serve):
    server = serve(http_port=0)
    client = openai_client(server)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="llama3", messages=[{"role": "user", "content": "Hi"}])
    assert info.value.body["param"] == "messages" and "no tokenizer" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="llama3", prompt="Hi")
    assert info.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="llama3", prompt=[1, 512])
    assert info.value.body["param"] == "prompt" and "out of range [0, 512)" in info.value.body["message"]
    req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/tokenize", json.dumps({"prompt": "x"}).encode())
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 400 and "no tokenizer" in json.loads(info.value.read())["error"]["message"]


def test_tls_and_the_grpc_token_as_api_key(serve, tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    server = serve(http_port=0, tls_cert_file=str(cert), tls_key_file=str(key), auth_token="tok")
    assert server.server.http.url.startswith("https://")
    context = ssl.create_default_context(cafile=str(cert))

    def get(path, token=None):
        conn = http.client.HTTPSConnection("127.0.0.1", server.http_port, context=context, timeout=30)
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
        response = conn.getresponse()
        return response.status, json.loads(response.read())

    assert get("/v1/models", "tok")[1]["data"][0]["id"] == "llama3"  # no API keys given: the gRPC token
    assert get("/v1/models", "other")[0] == 401 and get("/health")[0] == 200
    with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
        urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/health", timeout=10).read()


def test_a_taken_http_port_fails_at_start(serve):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=rf"cannot listen on 127.0.0.1:{port} \(http\)"):
            serve(http_port=port)
    assert openai_client(serve(http_port=0)).models.list().data[0].id == "llama3"  # the engine is still free


def test_beam_search_on_the_completions_route(serve, tiny_llm):
    """use_beam_search with n beams (vLLM's extra): the n choices are LLM.beam_search's beams, best
    first; what beam search cannot honour is refused by name."""
    from jaxinfer.sampling.beam import BeamSearchParams

    prompt = list(range(20, 37))
    (want,) = tiny_llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=7, length_penalty=0.5))
    server = serve(http_port=0)
    client = openai_client(server)
    extra = {"use_beam_search": True, "length_penalty": 0.5}
    done = client.completions.create(model="llama3", prompt=prompt, n=3, max_tokens=7, extra_body=extra)
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert [c.finish_reason for c in done.choices] == [s.finish_reason for s in want.sequences]
    assert done.usage.completion_tokens == sum(len(s.token_ids) for s in want.sequences)
    for fields, param in [
        (dict(stream=True), "stream"),
        (dict(temperature=0.8), "temperature"),
        (dict(n=9), "n"),
        (dict(logprobs=2), "logprobs"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(
                model="llama3", prompt=prompt, max_tokens=4, extra_body=extra, **{"n": 2, **fields}
            )
        assert info.value.body["param"] == param, info.value.body
