"""`jaxinfer serve`'s rate-limit and request-log flags: parsed into ServerOptions' fields, bad
values named before the model loads, and a served process that answers 429 and logs JSON lines."""

import json

import pytest
from openai_support import ServedProcess, raw_request, wait_for
from testpaths import TINY_SERVE_ARGS

from jaxinfer.cli import build_parser
from serving.cli import _limit_options
from serving.limits import RateLimits

TINY_ARGS = TINY_SERVE_ARGS
FLAGS = ("--rate-limit-rpm", "--rate-limit-tpm", "--max-concurrent-per-key", "--request-log", "--log-prompts")


def serve_args(*argv):
    return build_parser().parse_args(["serve", *argv])


def test_flags_become_server_options(tmp_path):
    log = tmp_path / "requests.jsonl"
    options = _limit_options(
        serve_args(
            "--rate-limit-rpm",
            "60",
            "--rate-limit-tpm",
            "1000",
            "--max-concurrent-per-key",
            "4",
            "--request-log",
            str(log),
            "--log-prompts",
        )
    )
    assert options == dict(rate_limits=RateLimits(60, 1000, 4), request_log=str(log), log_prompts=True)
    assert _limit_options(serve_args()) == dict(rate_limits=RateLimits(), request_log=None, log_prompts=False)
    assert not RateLimits().enabled


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--rate-limit-rpm", "0"], "--rate-limit-rpm 0: must be >= 1"),
        (["--rate-limit-tpm", "-5"], "--rate-limit-tpm -5: must be >= 1"),
        (["--max-concurrent-per-key", "0"], "--max-concurrent-per-key 0: must be >= 1"),
        (["--log-prompts"], "--log-prompts: needs --request-log"),
        (["--request-log", "/nonexistent-dir/requests.jsonl"], "--request-log /nonexistent-dir/requests.jsonl"),
    ],
)
def test_bad_flags_are_named(argv, message):
    with pytest.raises(ValueError, match=message):
        _limit_options(serve_args(*argv))


def test_help_lists_the_flags_in_their_group(capsys):
    with pytest.raises(SystemExit):
        serve_args("--help")
    text = capsys.readouterr().out
    group = text[text.index("per-key rate limits and request log") :]
    assert all(flag in group for flag in FLAGS) and "All off by default" in group


def test_served_process_limits_and_logs(tmp_path):
    log = tmp_path / "requests.jsonl"
    server = ServedProcess(
        [*TINY_ARGS, "--no-grpc", "--http-port", "0", "--rate-limit-rpm", "1", "--request-log", str(log)],
        tmp_path / "stderr",
        env={"JAXINFER_API_KEYS": "sk-cli"},
    )
    try:
        body = {"model": "llama3", "prompt": [1, 2, 3], "max_tokens": 2}
        status, _, _ = raw_request(server, "POST", "/v1/completions", body, key="sk-cli")
        assert status == 200, server.log()
        status, headers, data = raw_request(server, "POST", "/v1/completions", body, key="sk-cli")
        assert status == 429 and 55 <= int(headers["retry-after"]) <= 60
        assert "1 requests per minute" in json.loads(data)["error"]["message"]
        wait_for(lambda: len(log.read_text().splitlines()) == 2)  # written just after the answer
    finally:
        server.stop()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["status"] for line in lines] == [200, 429] and "sk-cli" not in log.read_text()
