"""Schemathesis against the served /openapi.json: the HTTP API of a real server on loopback
(BackgroundServer, HTTP only, on the package's tiny engine, which has no tokenizer: text and
chat are refused with a 400, token-id prompts generate) gets requests generated from its own
schema, valid ones and invalid ones, a bounded number per operation. None may answer 5xx or
break the connection; every answer must be a status the schema lists for the operation, of a
documented content type, with a body and headers that conform to the documented schema.

The schema is narrowed before generating, so each request stays cheap on two CPU cores: at most
4 new tokens, n <= 2, short prompts of ids inside the vocabulary (the served schema leaves
these to the server's limits). Examples are derandomized: every run sends the same requests.
"""

import copy
import urllib.request

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, example, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from serving_support import assert_pages_free

from serving.openai.schema import OPERATIONS
from serving.server import BackgroundServer, ServerOptions

EXAMPLES = {GenerationMode.POSITIVE: 30, GenerationMode.NEGATIVE: 15}  # per operation
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]
VOCAB = 512  # the tiny engine's
CAPS = {
    "max_tokens": {"maximum": 4},
    "max_completion_tokens": {"maximum": 4},
    "n": {"maximum": 2},
    "best_of": {"maximum": 2},
}


@pytest.fixture(scope="module")
def served(tiny_llm):
    server = BackgroundServer(tiny_llm.engine, ServerOptions(port=None, http_port=0, grace_period_s=2.0)).start()
    yield f"http://127.0.0.1:{server.http_port}"
    server.stop()
    assert_pages_free(server.server.engine_loop.engine)


def _cheap(raw: dict) -> dict:
    """The served schema with generation kept small (CAPS; prompts of <= 8 ids below VOCAB)."""
    schema = copy.deepcopy(raw)
    components = schema["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        for field, cap in CAPS.items():
            if field in components[name]["properties"]:
                components[name]["properties"][field].update(cap)
    ids = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": VOCAB - 1},
        "minItems": 1,
        "maxItems": 8,
    }
    prompt = components["CompletionRequest"]["properties"]["prompt"]
    prompt["anyOf"] = [
        {"type": "string", "maxLength": 16},
        {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 2},
        ids,
        {"type": "array", "items": ids, "minItems": 1, "maxItems": 2},
    ]
    return schema


@pytest.fixture(scope="module")
def api(served):
    import json

    with urllib.request.urlopen(f"{served}/openapi.json", timeout=30) as reply:
        raw = json.loads(reply.read())
    return schemathesis.openapi.from_dict(_cheap(raw))


# Valid requests sent first (hypothesis' explicit phase), so every run serves some for certain:
# token-id prompts whole and streamed, one refused for the model's lack of a tokenizer.
EXPLICIT = {
    "/v1/completions": [
        {"model": "llama3", "prompt": [1, 2, 3], "max_tokens": 3, "logprobs": 1, "echo": None, "stream": None},
        {
            "model": "llama3",
            "prompt": [[4, 5], [6.0]],
            "max_tokens": 2,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ],
    "/v1/chat/completions": [{"model": "llama3", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}],
    "/tokenize": [{"prompt": ""}],
    "/detokenize": [{"tokens": [1, 2]}],
}


@pytest.mark.parametrize("mode", list(EXAMPLES), ids=str)
@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda op: f"{op.method.upper()} {op.path}")
def test_generated_requests_get_documented_answers(served, api, operation, mode):
    endpoint = api[operation.path][operation.method.upper()]
    answered = []

    def run(case):
        response = case.call_and_validate(base_url=served, checks=CHECKS, timeout=60)
        answered.append(response.status_code)

    if mode is GenerationMode.NEGATIVE and operation.request is None and "{" not in operation.path:
        pytest.skip("nothing in the request to make invalid")
    test = given(case=endpoint.as_strategy(generation_mode=mode))(run)
    if mode is GenerationMode.POSITIVE:
        for body in EXPLICIT.get(operation.path, ()):
            test = example(case=endpoint.Case(body=body, media_type="application/json"))(test)
    settings(
        max_examples=EXAMPLES[mode],
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )(test)()
    assert answered and all(status < 500 for status in answered)
    if mode is GenerationMode.POSITIVE and operation.path in ("/v1/completions", "/v1/models", "/health"):
        assert answered.count(200) >= 2 if operation.path == "/v1/completions" else 200 in answered, answered
