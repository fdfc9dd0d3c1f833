"""Tool calling in the chat API without a server (serving/tools.py, serving/openai/tools.py):
tools and tool_choice checked with errors naming the field, the prompt the template renders,
the structured output of "required" and named choices, whole messages and streamed deltas (a
streamed choice adds up to the whole one, however its text is cut); the same over gRPC's Chat
(tools and calls as JSON text, calls on the finishing delta)."""

import dataclasses
import json
import random

import jsonschema
import pytest
from testpaths import FIXTURES

from jaxinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput, Usage
from jaxinfer.sampling import SamplingParams
from jaxinfer.structured import GrammarBackend
from jaxinfer.tokenizer import load_tokenizer
from jaxinfer.tokenizer.tool_calls import HermesParser, Llama3JsonParser, MistralParser
from serving.errors import RequestError
from serving.grpc import convert
from serving.grpc.proto import jaxinfer_pb2 as pb
from serving.model_limits import ModelLimits
from serving.openai import outputs
from serving.openai.errors import APIError
from serving.openai.inputs import chat_inputs
from serving.openai.protocol import ChatCompletionRequest
from serving.openai.tools import ToolStream, message
from serving.tools import ChatReplies, tool_request

LIMITS = ModelLimits(vocab_size=49152, max_model_len=512, penalties_enabled=False, max_n=4)
USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time"}}


@pytest.fixture(scope="module")
def tok():
    tokenizer = load_tokenizer(str(FIXTURES / "smollm2"))
    tokenizer.chat_template = (FIXTURES / "templates" / "hermes_tools.jinja").read_text()
    tokenizer.limits = dataclasses.replace(LIMITS, grammars=GrammarBackend(tokenizer, 49152))
    return tokenizer


HERMES = HermesParser()


def chat(tok, parser=HERMES, **body):
    body = {"model": "m", "messages": USER, **body}
    return chat_inputs(ChatCompletionRequest.model_validate(body), tok, tok.limits, tool_parser=parser)


def test_tools_reach_the_template_and_auto_reads_the_output(tok):
    inputs = chat(tok, tools=[WEATHER, TIME])
    prompt = tok.decode(inputs.prompts[0], skip_special_tokens=False)
    assert json.dumps(WEATHER["function"]) in prompt and json.dumps(TIME["function"]) in prompt
    assert inputs.tools.mode == "auto" and isinstance(inputs.tools.parser, HermesParser)
    assert inputs.params.structured_output is None
    # "none": the template still shows the tools (as vLLM does); the output is plain text
    none = chat(tok, tools=[WEATHER], tool_choice="none")
    assert none.tools is None and none.prompts == chat(tok, tools=[WEATHER]).prompts != chat(tok).prompts


def test_a_conversation_with_calls_and_results(tok):
    messages = USER + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]
    prompt = tok.decode(chat(tok, tools=[WEATHER], messages=messages).prompts[0], skip_special_tokens=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n18C\n</tool_response>" in prompt


def test_required_and_named_choices_constrain_the_output(tok):
    required = chat(tok, tools=[WEATHER, TIME], tool_choice="required").params.structured_output.json
    good = [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(good, required)
    for bad in ([], [{"name": "get_wind", "parameters": {}}], [{"name": "get_weather", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    single = chat(tok, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert single.params.structured_output.json["maxItems"] == 1
    named = chat(tok, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.params.structured_output.json == WEATHER["function"]["parameters"]
    # a named choice works on any model: no format needed
    assert chat(tok, parser=None, tools=[WEATHER], tool_choice="required").tools.mode == "required"


def test_a_format_whose_marker_is_special_keeps_special_tokens(tok):
    assert chat(tok, parser=MistralParser(), tools=[WEATHER]).params.skip_special_tokens is False
    assert chat(tok, parser=MistralParser(), tools=[WEATHER], skip_special_tokens=True).params.skip_special_tokens
    assert chat(tok, tools=[WEATHER]).params.skip_special_tokens is True


@pytest.mark.parametrize(
    "body, param, words",
    [
        (dict(tools={"type": "function"}), "tools", "non-empty list"),
        (dict(tools=[]), "tools", "non-empty list"),
        (
            dict(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]),
            "tools",
            "129 tools; at most 128",
        ),
        (dict(tools=[{"type": "retrieval"}]), "tools[0].type", '"retrieval": only "function" tools'),
        (dict(tools=[{"type": "function"}]), "tools[0].function", "required"),
        (dict(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools[0].function.name", '"a b": must be'),
        (dict(tools=[WEATHER, WEATHER]), "tools[1].function.name", "named twice"),
        (
            dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
            "tools[0].function.parameters",
            "JSON schema object",
        ),
        (dict(tool_choice="required"), "tool_choice", "needs tools"),
        (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice", 'must be "none", "auto", "required"'),
        (
            dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_time"}}),
            "tool_choice.function.name",
            "'get_time': not among the tools (get_weather)",
        ),
        (
            dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
            "response_format",
            "not together with tool_choice='required'",
        ),
        (dict(functions=[{"name": "f"}]), "functions", "use tools"),
        (
            dict(
                tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}],
                tool_choice="required",
            ),
            "tools",
            "json",
        ),
        (
            dict(messages=[{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]),
            "messages[0].tool_calls[0].function.arguments",
            "JSON object",
        ),
        (
            dict(messages=[{"role": "assistant", "tool_calls": [{"type": "function"}]}]),
            "messages[0].tool_calls[0].function",
            "with a name",
        ),
        (dict(messages=[{"role": "tool", "tool_call_id": "c"}]), "messages[0].content", "required"),
    ],
)
def test_tool_errors_name_the_field(tok, body, param, words):
    with pytest.raises(APIError) as info:
        chat(tok, **body)
    assert info.value.status == 400 and info.value.param == param, info.value.message
    assert info.value.message.startswith(param) and words in info.value.message, info.value.message


def test_auto_needs_a_format(tok):
    with pytest.raises(APIError, match='tool_choice="auto": .*--tool-call-parser') as info:
        chat(tok, parser=None, tools=[WEATHER])
    assert info.value.param == "tool_choice"


def output(text: str, reason: str | None = "stop") -> RequestOutput:
    return RequestOutput(
        "r",
        None,
        [1, 2, 3],
        [CompletionOutput(0, text, [1], None, reason)],
        reason is not None,
        Usage(3, 1, 0),
        RequestMetrics(0.0),
    )


def test_whole_messages():
    head = outputs.ResponseHeader("chatcmpl-1", "chat.completion", 0, "m")
    texts = outputs.TokenTexts(None)
    auto = tool_request([WEATHER], None, None, HermesParser())
    body = outputs.chat_response(
        head,
        output('Checking.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'),
        texts,
        auto,
    )
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) == 29
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    plain = outputs.chat_response(head, output("It is sunny.", "length"), texts, auto)["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "It is sunny."} and plain["finish_reason"] == "length"
    named = tool_request([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None, None)
    choice = outputs.chat_response(head, output('{"city": "Rome"}'), texts, named)["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    required = tool_request([WEATHER], "required", None, None)
    choice = outputs.chat_response(
        head, output('[{"name": "get_weather", "parameters": {"city": "Nice"}}]'), texts, required
    )["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Nice"}'}


STREAMED = [
    (
        HermesParser(),
        'Checking the weather.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    ),
    (HermesParser(), "A plain answer <b>with</b> a <tool_ lookalike and trailing space  "),
    (HermesParser(), '<tool_call>{"name": "get_weather", "arguments": {"ci'),  # cut short: stays content
    (HermesParser(), 'x <tool_call>{"bad"}</tool_call> y <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'),
    (
        Llama3JsonParser(),
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}',
    ),
    (Llama3JsonParser(), "  Just text, with a { brace."),
    (MistralParser(), 'On it. [TOOL_CALLS][{"name": "get_time", "arguments": {}}]'),
    (MistralParser(), "[TOOL_CAL is not the marker"),
]


@pytest.mark.parametrize("parser, text", STREAMED)
def test_a_streamed_choice_adds_up_to_the_whole_one(parser, text):
    request = tool_request([WEATHER, TIME], "auto", None, parser)
    whole, reason = message(request, text, "stop")
    rng = random.Random(0)
    for cut in range(6):
        stream, content, calls, pos = ToolStream(request), "", [], 0
        while pos < len(text):
            step = 1 if cut == 0 else rng.randint(1, 9)
            shown, deltas = stream.feed(text[pos : pos + step], pos + step >= len(text))
            pos += step
            content += shown
            calls += deltas
        assert (content or None) == whole["content"]
        assert [c["function"] for c in calls] == [c["function"] for c in whole.get("tool_calls", [])]
        assert [c["index"] for c in calls] == list(range(len(calls)))


def test_chunks_of_a_streamed_named_call():
    head = outputs.ResponseHeader("chatcmpl-1", "chat.completion.chunk", 0, "m")
    named = tool_request([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None, None)
    writer = outputs.ChunkWriter(head, 1, outputs.TokenTexts(None), False, tools=named)
    chunks = writer.deltas(0, output('{"city": ', None)) + writer.deltas(0, output('"Oslo"}'))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    first = deltas[0]["tool_calls"][0]
    assert first["id"].startswith("call_") and first["function"] == {"name": "get_weather", "arguments": '{"city": '}
    assert deltas[1] == {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}
    assert deltas[2] == {} and chunks[2]["choices"][0]["finish_reason"] == "stop"


def grpc_chat(**fields) -> pb.Chat:
    messages = fields.pop("messages", [pb.ChatMessage(role="user", content="Weather in Paris?")])
    return pb.Chat(messages=messages, **fields)


def test_grpc_chats_render_tools_calls_and_results(tok):
    calls = json.dumps(
        [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    )
    chat = grpc_chat(
        tools_json=json.dumps([WEATHER]),
        messages=[
            pb.ChatMessage(role="user", content="Weather in Paris?"),
            pb.ChatMessage(role="assistant", tool_calls_json=calls),
            pb.ChatMessage(role="tool", tool_call_id="c1", content="18C"),
        ],
    )
    prompt = tok.decode(convert.render_chat(tok, chat), skip_special_tokens=False)
    assert json.dumps(WEATHER["function"]) in prompt and "<tool_response>\n18C\n</tool_response>" in prompt
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    # the same prompt as the HTTP API renders for the same conversation
    http = chat_inputs(
        ChatCompletionRequest.model_validate(
            {
                "model": "m",
                "tools": [WEATHER],
                "messages": [
                    {"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "tool_calls": json.loads(calls)},
                    {"role": "tool", "tool_call_id": "c1", "content": "18C"},
                ],
            }
        ),
        tok,
        tok.limits,
        HermesParser(),
    )
    assert http.prompts[0] == convert.render_chat(tok, chat)


def test_grpc_tool_choices_and_their_sampling(tok):
    assert convert.chat_tools(grpc_chat(), HermesParser()) is None
    auto = convert.chat_tools(grpc_chat(tools_json=json.dumps([WEATHER])), HermesParser())
    assert auto.mode == "auto" and isinstance(auto.parser, HermesParser)
    named = convert.chat_tools(grpc_chat(tools_json=json.dumps([WEATHER, TIME]), tool_choice="get_time"), None)
    assert named.mode == "named" and named.name == "get_time"
    params = convert.with_tools(SamplingParams(), named, pb.SamplingOptions())
    assert params.structured_output.json == {"type": "object"}
    required = convert.chat_tools(
        grpc_chat(tools_json=json.dumps([WEATHER]), tool_choice="required", parallel_tool_calls=False), None
    )
    assert convert.with_tools(SamplingParams(), required, pb.SamplingOptions()).structured_output.json["maxItems"] == 1
    mistral = convert.chat_tools(grpc_chat(tools_json=json.dumps([WEATHER])), MistralParser())
    assert convert.with_tools(SamplingParams(), mistral, pb.SamplingOptions()).skip_special_tokens is False
    kept = pb.SamplingOptions(skip_special_tokens=True)
    assert convert.with_tools(SamplingParams(), mistral, kept) == SamplingParams()


@pytest.mark.parametrize(
    "chat, message",
    [
        (dict(tools_json="[{"), "chat.tools_json: not valid JSON"),
        (dict(tools_json="[" * 100_000 + "]" * 100_000), "chat.tools_json: not valid JSON"),  # nested too deeply
        (
            dict(
                messages=[
                    pb.ChatMessage(
                        role="assistant",
                        tool_calls_json=json.dumps([{"function": {"name": "f", "arguments": "[" * 100_000}}]),
                    )
                ]
            ),
            "chat.messages[0].tool_calls_json[0].function.arguments: must be a JSON object",
        ),
        (dict(tools_json='[{"type": "function", "function": {"name": "a b"}}]'), 'chat.tools[0].function.name="a b"'),
        (dict(tool_choice="required"), 'chat.tool_choice="required": needs tools'),
        (dict(tools_json=json.dumps([WEATHER]), tool_choice="get_time"), "chat.tool_choice.function.name='get_time'"),
        (
            dict(messages=[pb.ChatMessage(role="assistant", tool_calls_json='{"a": 1}')]),
            "chat.messages[0].tool_calls_json: must be a JSON list",
        ),
        (
            dict(
                messages=[
                    pb.ChatMessage(role="assistant", tool_calls_json='[{"function": {"name": "f", "arguments": 3}}]')
                ]
            ),
            "chat.messages[0].tool_calls_json[0].function.arguments: must be a JSON object",
        ),
    ],
)
def test_grpc_tool_errors_name_the_field(tok, chat, message):
    with pytest.raises(RequestError) as info:
        convert.render_chat(tok, grpc_chat(**chat))
        convert.chat_tools(grpc_chat(**chat), HermesParser())
    assert str(info.value).startswith(message), str(info.value)


def test_grpc_finishing_deltas_carry_the_calls():
    replies = ChatReplies(tool_request([WEATHER], None, None, HermesParser()))
    first = convert.response(output("Checking.\n<tool_call>", None), replies)
    assert not first.outputs[0].tool_calls and not first.outputs[0].HasField("content")
    last = convert.response(output('{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'), replies)
    delta = last.outputs[0]
    assert delta.content == "Checking." and delta.text.startswith('{"name"') and delta.finish_reason == "stop"
    assert [(c.name, c.arguments) for c in delta.tool_calls] == [("get_weather", '{"city": "Oslo"}')]
    assert delta.tool_calls[0].id.startswith("call_")
    assert not convert.response(output("x")).outputs[0].HasField("content")  # no tools: nothing read


def test_reasoning_then_calls_whole_and_streamed():
    from jaxinfer.tokenizer.reasoning import reasoning_parser

    qwen3, auto = reasoning_parser("qwen3"), tool_request([WEATHER, TIME], None, None, HermesParser())
    text = (
        '<think>\nThe user wants weather.\n</think>\n\nChecking.\n<tool_call>\n{"name": "get_time", '
        '"arguments": {}}\n</tool_call>'
    )
    head = outputs.ResponseHeader("chatcmpl-1", "chat.completion", 0, "m")
    choice = outputs.chat_response(head, output(text), outputs.TokenTexts(None), auto, qwen3)["choices"][0]
    assert choice["message"]["reasoning_content"] == "The user wants weather."
    assert choice["message"]["content"] == "Checking." and choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    plain = outputs.chat_response(head, output("Paris."), outputs.TokenTexts(None), None, qwen3)["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "Paris.", "reasoning_content": None}
    head.object = "chat.completion.chunk"
    for tools in (auto, None):
        writer = outputs.ChunkWriter(head, 1, outputs.TokenTexts(None), False, tools=tools, reasoning=qwen3)
        chunks = []
        for i in range(0, len(text), 5):
            chunks += writer.deltas(0, output(text[i : i + 5], None if i + 5 < len(text) else "stop"))
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user wants weather."
        whole, _ = message(tools, text, "stop", qwen3)
        assert "".join(d.get("content", "") for d in deltas) == whole["content"]
        assert [c["function"] for d in deltas for c in d.get("tool_calls", [])] == [
            c["function"] for c in whole.get("tool_calls", [])
        ]


def test_chat_template_kwargs_reach_the_template(tok):
    template = "{% if enable_thinking is false %}NO-THINK {% endif %}{{ messages[0].content }}"
    tok_template, tok.chat_template = tok.chat_template, template
    try:
        inputs = chat(tok, chat_template_kwargs={"enable_thinking": False})
        assert tok.decode(inputs.prompts[0]) == "NO-THINK Weather in Paris?"
        chat_kwargs = json.dumps({"enable_thinking": False})
        assert (
            tok.decode(convert.render_chat(tok, grpc_chat(chat_template_kwargs_json=chat_kwargs)))
            == "NO-THINK Weather in Paris?"
        )
        with pytest.raises(APIError) as info:
            chat(tok, chat_template_kwargs={"messages": []})
        assert info.value.param == "chat_template_kwargs" and "set by the request itself" in info.value.message
        with pytest.raises(RequestError, match=r"^chat\.chat_template_kwargs=\[1\]: must be an object"):
            convert.render_chat(tok, grpc_chat(chat_template_kwargs_json="[1]"))
    finally:
        tok.chat_template = tok_template


def test_grpc_finishing_deltas_carry_the_reasoning():
    from jaxinfer.tokenizer.reasoning import reasoning_parser

    request = pb.GenerateRequest(chat=grpc_chat())
    replies = convert.chat_replies(request, None, reasoning_parser("deepseek_r1"))
    delta = convert.response(output("Hmm.\n</think>\n\nParis."), replies).outputs[0]
    assert (delta.reasoning_content, delta.content, len(delta.tool_calls)) == ("Hmm.", "Paris.", 0)
    assert convert.chat_replies(pb.GenerateRequest(text="x"), None, reasoning_parser("qwen3")) is None
    assert convert.chat_replies(request, None, None) is None


def test_tokenize_renders_tools_as_chat_does(tok):
    from serving.openai.messages import render_messages, template_tools
    from serving.openai.protocol import TokenizeRequest

    req = TokenizeRequest.model_validate({"messages": USER, "tools": [WEATHER]})
    assert render_messages(req.messages, tok, True, template_tools(req.tools)) == chat(tok, tools=[WEATHER]).prompts[0]
    with pytest.raises(APIError) as info:
        template_tools([{"type": "function", "function": {"name": ""}}])
    assert info.value.param == "tools[0].function.name"


def test_a_constrained_output_has_reasoning_only_where_it_writes_think():
    from jaxinfer.sampling import StructuredOutput
    from jaxinfer.tokenizer.reasoning import reasoning_parser
    from serving.tools import reasoning_for

    r1, spec = reasoning_parser("deepseek_r1"), StructuredOutput(json_object=True)
    assert r1.split('{"a": 1}') == ('{"a": 1}', "")  # free output: starts inside the reasoning
    assert reasoning_for(r1, spec, False).split('{"a": 1}') == (None, '{"a": 1}')  # a grammar made it: no reasoning
    assert reasoning_for(r1, spec, False).split("<think>x</think>{}") == ("x", "{}")
    assert reasoning_for(r1, None, False) is r1 and reasoning_for(None, spec, False) is None
    # an engine that gates its grammars behind the reasoning: read as any output
    assert reasoning_for(r1, spec, True) is r1 and r1.split('x</think>{"a": 1}') == ("x", '{"a": 1}')
    named = tool_request([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None, None)
    message_, _ = message(named, '{"city": "Oslo"}', "stop", reasoning_for(r1, named.structured_output, False))
    assert message_["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    assert message_["reasoning_content"] is None
    request = pb.GenerateRequest(chat=grpc_chat())
    delta = convert.response(output('{"a": 1}'), convert.chat_replies(request, None, r1, spec)).outputs[0]
    assert delta.content == '{"a": 1}' and not delta.HasField("reasoning_content")
