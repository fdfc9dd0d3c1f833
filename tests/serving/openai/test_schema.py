"""The HTTP API's published schema and docs, without an engine (the ASGI app called directly):
/openapi.json covers every route and is generated from the request models the handlers parse,
every optional field is nullable as in OpenAI's reference, /docs is Swagger UI from local files
only, and the conformance fixes: null means the default, 405 keeps `Allow`, token ids written as
integral floats are ids (others are named by index), and an empty prompt is read alike by
/tokenize and /v1/completions."""

import concurrent.futures
import json
import re

import jsonschema
import pytest
from openai_support import asgi_request
from testpaths import FIXTURES

from jaxinfer.tokenizer import load_tokenizer
from serving.model_limits import ModelLimits
from serving.openai import protocol, responses
from serving.openai.app import build_app
from serving.openai.errors import APIError
from serving.openai.handlers import ApiContext
from serving.openai.inputs import chat_inputs, completion_inputs
from serving.openai.schema import OPERATIONS, openapi_schema

LIMITS = ModelLimits(vocab_size=49152, max_model_len=128, penalties_enabled=False, max_n=4)
REF = "#/components/schemas/{model}"
# The documents themselves, as FastAPI's, and the playground page.
NOT_DOCUMENTED = {"/openapi.json", "/docs", "/docs/{asset}", "/ui"}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(FIXTURES / "smollm2"))


@pytest.fixture(scope="module")
def app(tok):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        yield build_app(ApiContext(None, tok, LIMITS, "m", pool))


def _inline(schema, components):
    """The schema with its component references replaced by the components (none is recursive)."""
    if isinstance(schema, dict):
        if "$ref" in schema:
            return _inline(components[schema["$ref"].rsplit("/", 1)[1]], components)
        return {k: _inline(v, components) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_inline(v, components) for v in schema]
    return schema


def test_every_route_is_documented(app):
    served = {
        (route.path.replace("{model:path}", "{model}"), method.lower())
        for route in app.routes
        for method in route.methods
        if method != "HEAD" and route.path not in NOT_DOCUMENTED
    }
    schema = openapi_schema("m")
    assert {(path, method) for path, ops in schema["paths"].items() for method in ops} == served
    assert schema["openapi"] == "3.1.0" and "securitySchemes" not in schema["components"]


def test_request_bodies_are_the_parsed_models():
    schema = openapi_schema("m")
    seen = set()  # a body two routes read (a generation route and its render) is checked once
    for op in OPERATIONS:
        if op.request is None or op.request in seen:
            continue
        seen.add(op.request)
        ref = schema["paths"][op.path][op.method]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        own = op.request.model_json_schema(ref_template=REF)
        own.pop("$defs", None)
        served = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
        model = served["properties"].pop("model")  # the served model's name, written in
        assert [model] == [{"type": "string", "enum": ["m"], "title": "Model"}] or model["anyOf"] == [
            {"type": "string", "enum": ["m"]},
            {"type": "null"},
        ]
        own["properties"].pop("model")
        assert served == own


def test_every_optional_field_is_nullable():
    components = openapi_schema("m")["components"]["schemas"]
    models = [
        protocol.CompletionRequest,
        protocol.ChatCompletionRequest,
        protocol.TokenizeRequest,
        protocol.DetokenizeRequest,
        protocol.StreamOptions,
        protocol.ChatMessage,
    ]
    for model in models:
        spec = components[model.__name__]
        for name, prop in spec["properties"].items():
            if name not in spec.get("required", ()):
                jsonschema.validate(None, _inline(prop, components))  # raises naming the field's schema


def test_errors_and_security_are_documented():
    schema = openapi_schema("m", api_keys=True)
    completions = schema["paths"]["/v1/completions"]["post"]
    assert set(completions["responses"]) == {"200", "400", "401", "404", "413", "429", "500", "503"}
    assert set(completions["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert completions["security"] == [{"bearer": []}] and "security" not in schema["paths"]["/health"]["get"]
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


def test_docs_page_loads_swagger_ui_from_local_files(app):
    status, headers, page = asgi_request(app, "GET", "/docs")
    assert status == 200 and headers["content-type"].startswith("text/html")
    html = page.decode()
    assert "http://" not in html and "https://" not in html  # nothing from the internet
    linked = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert sorted(linked) == ["/docs/swagger-ui-bundle.js", "/docs/swagger-ui.css"] and '"/openapi.json"' in html
    for path in linked:
        status, headers, body = asgi_request(app, "GET", path)
        assert status == 200 and len(body) > 10_000, path
        assert headers["content-type"].split(";")[0] in ("text/css", "text/javascript")
    assert b"SwaggerUIBundle" in asgi_request(app, "GET", "/docs/swagger-ui-bundle.js")[2]
    status, _, body = asgi_request(app, "GET", "/docs/index.html")  # only the two files the page loads
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found"
    status, _, body = asgi_request(app, "GET", "/openapi.json")
    assert status == 200 and json.loads(body) == json.loads(json.dumps(openapi_schema("m")))


def test_405_keeps_the_allow_header(app):
    status, headers, body = asgi_request(app, "POST", "/v1/models", {})
    assert status == 405 and set(headers["allow"].replace(" ", "").split(",")) >= {"GET"}
    assert json.loads(body)["error"]["message"].startswith("POST /v1/models: ")
    status, headers, _ = asgi_request(app, "GET", "/tokenize")
    assert status == 405 and headers["allow"] == "POST"


def test_null_means_the_default(tok):
    nulls = dict(logprobs=None, echo=None, stream=None, stream_options=None, n=None, max_tokens=None, stop=None)
    plain = completion_inputs(protocol.CompletionRequest.model_validate({"model": "m", "prompt": "Hi"}), tok, LIMITS)
    nulled = completion_inputs(
        protocol.CompletionRequest.model_validate({"model": "m", "prompt": "Hi", **nulls}), tok, LIMITS
    )
    assert nulled == plain
    messages = [{"role": "user", "content": "Hi"}]
    chat = protocol.ChatCompletionRequest.model_validate(
        {"model": "m", "messages": messages, "logprobs": None, "stream": None, "add_generation_prompt": None}
    )
    assert (chat.logprobs, chat.stream, chat.add_generation_prompt) == (False, False, True)
    assert chat_inputs(chat, tok, LIMITS) == chat_inputs(
        protocol.ChatCompletionRequest.model_validate({"model": "m", "messages": messages}), tok, LIMITS
    )
    tokenize = protocol.TokenizeRequest.model_validate(
        {"prompt": "x", "add_special_tokens": None, "add_generation_prompt": None}
    )
    assert (tokenize.add_special_tokens, tokenize.add_generation_prompt) == (True, True)
    with pytest.raises(Exception, match="model"):  # a required field stays required
        protocol.CompletionRequest.model_validate({"model": None, "prompt": "Hi"})


def test_token_ids_written_as_floats(tok, app):
    def completion(prompt):
        return completion_inputs(
            protocol.CompletionRequest.model_validate({"model": "m", "prompt": prompt}), tok, LIMITS
        )

    assert completion([272.0, 5]).prompts == [[272, 5]] and completion([[1.0], [2]]).prompts == [[1], [2]]
    for prompt, param, message in (
        ([5, 272.5], "prompt", "prompt[1]: 272.5 is not an integer token id"),
        ([[1], [2, 0.5]], "prompt[1]", "prompt[1][1]: 0.5 is not an integer token id"),
    ):
        with pytest.raises(APIError) as info:
            completion(prompt)
        assert (info.value.status, info.value.param, info.value.message) == (400, param, message)
    status, _, body = asgi_request(app, "POST", "/detokenize", {"tokens": [6004.0]})
    assert status == 200 and json.loads(body)["prompt"] == "hi"
    status, _, body = asgi_request(app, "POST", "/detokenize", {"tokens": [6004, 1.5]})
    assert status == 400 and json.loads(body)["error"]["message"].startswith("tokens[1]=1.5: ")


class _WithBos:
    """The fixture's tokenizer, writing a BOS (id 1) first, as Llama's does."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + self.tok.encode(text, add_special_tokens)


def test_an_empty_prompt_is_read_as_tokenize_reads_it(tok, app):
    status, _, body = asgi_request(app, "POST", "/tokenize", {"prompt": ""})
    assert status == 200 and json.loads(body)["tokens"] == tok.encode("") == []  # SmolLM2 writes no BOS
    with pytest.raises(APIError) as info:
        completion_inputs(protocol.CompletionRequest.model_validate({"model": "m", "prompt": ""}), tok, LIMITS)
    assert info.value.param == "prompt" and "the prompt has no tokens" in info.value.message
    bos = _WithBos(tok)  # a tokenizer that gives "" a token: a completion starts from it, as in vLLM
    assert (
        completion_inputs(
            protocol.CompletionRequest.model_validate({"model": "m", "prompt": ["", "hi"]}), bos, LIMITS
        ).prompts
        == [bos.encode(""), bos.encode("hi")]
        == [[1], [1, 6004]]
    )


def test_response_models_describe_the_bodies(app):
    status, _, body = asgi_request(app, "GET", "/v1/models")
    responses.ModelList.model_validate_json(body)
    status, _, body = asgi_request(app, "POST", "/tokenize", {"prompt": "hi"})
    assert responses.TokenizeResponse.model_validate_json(body).tokens == [6004]
    status, _, body = asgi_request(app, "GET", "/v1/models/other")
    assert status == 404 and responses.ErrorResponse.model_validate_json(body).error.param == "model"
