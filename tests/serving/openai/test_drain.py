"""`jaxinfer serve --no-grpc --http-port 0` (the embedded SmolLM2, whose steps are slow enough
to stay in flight): API keys from a file, then SIGTERM with streams in flight: /health and new
requests get 503 at once, the streams finish within the grace period, and the process exits 0.
Bad HTTP flags of `serve` are refused before the model loads."""

import signal
import threading
import time

import openai
import pytest
from openai_support import ServedProcess, raw_request, wait_for

from jaxinfer.cli import main

MODEL = "SmolLM2-135M-Instruct"
ARGS = [
    "--max-model-len",
    "512",
    "--max-num-batched-tokens",
    "64",
    "--token-buckets",
    "16,64",
    "--max-num-seqs",
    "8",
    "--num-pages",
    "128",
    "--no-penalties",
]  # as openai/test_api.py: compiled once
MAX_TOKENS = 48  # two streams: ~3 s of engine steps on a 2-core CPU


@pytest.fixture
def served(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# operators\nsk-ops-1\nsk-ops-2  # spare\n")
    server = ServedProcess(
        [*ARGS, "--no-grpc", "--http-port", "0", "--api-keys-file", str(keys), "--grace-period", "60"], tmp_path / "log"
    )
    yield server
    server.stop()


def test_http_only_server_drains_on_sigterm(served):
    assert served.grpc is None  # HTTP only
    assert raw_request(served, "GET", "/health")[0] == 200
    assert raw_request(served, "GET", "/v1/models", key="sk-ops-3")[0] == 401
    client = openai.OpenAI(base_url=f"{served.http}/v1", api_key="sk-ops-2", max_retries=0, timeout=120)
    results, errors = {}, []
    first_chunk = threading.Barrier(3)

    def stream(k):
        try:
            tokens, finish = [], None
            for i, chunk in enumerate(
                client.completions.create(
                    model=MODEL,
                    prompt=f"Story number {k}:",
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    logprobs=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
            ):
                if i == 0:
                    first_chunk.wait(60)
                if chunk.choices and chunk.choices[0].logprobs:
                    tokens += chunk.choices[0].logprobs.tokens
                finish = chunk.choices[0].finish_reason or finish
            results[k] = (len(tokens), finish, time.monotonic())
        except Exception as e:  # asserted below
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(k,)) for k in (3, 4)]
    for t in threads:
        t.start()
    first_chunk.wait(60)  # both streams are in flight
    served.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: raw_request(served, "GET", "/health")[0] == 503, timeout=10)
    draining_seen = time.monotonic()
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert info.value.status_code == 503 and info.value.body["code"] == "shutting_down"
    for t in threads:
        t.join(120)
    assert served.proc.wait(60) == 0, served.log()
    assert not errors, errors
    assert {k: r[:2] for k, r in results.items()} == {3: (MAX_TOKENS, "length"), 4: (MAX_TOKENS, "length")}
    assert all(r[2] > draining_seen for r in results.values())  # they were still streaming while draining


@pytest.mark.parametrize(
    "args,message",
    [
        (["--no-grpc"], "--no-grpc: needs --http-port"),
        (["--http-port", "70000"], "--http-port 70000: must be in [0, 65535]"),
        (
            ["--http-port", "0", "--api-keys-file", "/nonexistent/keys"],
            "--api-keys-file /nonexistent/keys: does not exist",
        ),
        (["--http-port", "0", "--max-body-bytes", "0"], "--max-body-bytes 0: must be >= 1"),
        (["--http-port", "0", "--tool-call-parser", "xml"], "--tool-call-parser xml: unknown; choose one of hermes,"),
        (
            ["--http-port", "0", "--reasoning-parser", "none"],
            "--reasoning-parser none: unknown; choose one of deepseek_r1",
        ),
    ],
)
def test_serve_refuses_bad_http_flags_before_loading(args, message, capsys):
    assert main(["serve", *args]) == 2
    assert capsys.readouterr().err.startswith(f"error: {message}")
