"""Tool calling over HTTP with the official `openai` client and over gRPC: a real `jaxinfer serve`
of the embedded SmolLM2 with a chat template that renders tools (`--chat-template`, whose markers
make the server read hermes-format calls), named and required choices constrained to valid
calls, auto calls read out of the text whole and streamed, a conversation carrying a tool's
result, and the same calls from both transports."""
import json

import grpc
import jsonschema
import openai
import pytest
from openai_support import ServedProcess
from testpaths import FIXTURES

from serving.client import Client
from serving.proto import jaxinfer_pb2 as pb

MODEL = "SmolLM2-135M-Instruct"
ARGS = ["--max-model-len", "512", "--max-num-batched-tokens", "64", "--token-buckets", "16,64",
        "--max-num-seqs", "8", "--num-pages", "128", "--no-penalties", "--port", "0", "--http-port", "0",
        "--chat-template", str(FIXTURES / "templates" / "hermes_tools.jinja")]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string", "maxLength": 20}},
                                             "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>'


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    server = ServedProcess(ARGS, tmp_path_factory.mktemp("serve") / "log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.http}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def grpc_client(served):
    with Client(served.grpc) as c:
        yield c


def create(client, **kwargs):
    kwargs = {"messages": ASK, "temperature": 0, "max_tokens": 60, "tools": [WEATHER, TIME], **kwargs}
    return client.chat.completions.create(model=MODEL, **kwargs)


def streamed(client, **kwargs) -> tuple[str, dict, str]:
    """(content, {index: call with its arguments joined}, finish_reason) of a streamed choice."""
    content, calls, finish = "", {}, None
    for chunk in create(client, stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            call["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def test_a_named_function_gets_valid_arguments(client):
    reply = create(client, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    content, calls, finish = streamed(client, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert content == "" and finish == "stop" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == call.function.arguments


def test_required_makes_at_least_one_valid_call(client):
    reply = create(client, tool_choice="required", parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    content, calls, finish = streamed(client, tool_choice="required", parallel_tool_calls=False)
    assert finish == "tool_calls" and [(c["name"], c["arguments"]) for c in calls.values()] == [
        (call.function.name, call.function.arguments)]


def test_auto_reads_calls_out_of_the_text(client):
    # the model's text forced to a hermes call: what a tool-tuned model writes
    reply = create(client, extra_body={"guided_choice": [f"Let me check.\n{CALL}"]})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {"city": "Oslo"})
    content, calls, finish = streamed(client, extra_body={"guided_choice": [f"Let me check.\n{CALL}"]})
    assert (content, finish) == ("Let me check.", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_time", call.function.arguments)]
    # text that makes no call is the content, unchanged
    plain = create(client, extra_body={"guided_choice": ["No <tool_call> needed."]}).choices[0]
    assert plain.message.content == "No <tool_call> needed." and plain.message.tool_calls is None
    assert plain.finish_reason == "stop"


def test_a_conversation_with_a_tool_result(client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18, "sky": "clear"}'}]
    reply = create(client, messages=messages, tool_choice="none", max_tokens=16)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content
    assert reply.usage.prompt_tokens > 150  # the tools, the call and its result are in the prompt
    with pytest.raises(openai.BadRequestError) as info:
        create(client, messages=messages[:2] + [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{oops"}}]}])
    assert info.value.body["param"] == "messages[2].tool_calls[0].function.arguments"


def test_grpc_gets_the_same_calls(client, grpc_client):
    assert grpc_client.model_info().tool_call_format == "hermes"  # the --chat-template's markers
    named = create(client, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    got = grpc_client.generate(messages=ASK, tools=[WEATHER, TIME], tool_choice="get_weather", temperature=0,
                               max_tokens=60).outputs[0]
    (call,) = got.tool_calls
    assert call.id.startswith("call_") and call.name == "get_weather" and got.content == ""
    assert call.arguments == named.choices[0].message.tool_calls[0].function.arguments == got.text
    forced = pb.StructuredOutput(choice=pb.StructuredOutput.Choices(choices=[f"Let me check.\n{CALL}"]))
    got = grpc_client.generate(messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=60,
                               structured_output=forced).outputs[0]
    assert got.text == f"Let me check.\n{CALL}" and got.content == "Let me check." and got.finish_reason == "stop"
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == [("get_time", {"city": "Oslo"})]
    plain = grpc_client.generate(messages=ASK, temperature=0, max_tokens=4).outputs[0]
    assert plain.tool_calls == [] and plain.content is None  # no tools: nothing read
    with pytest.raises(grpc.RpcError) as info:
        grpc_client.generate(messages=ASK, tools=[WEATHER], tool_choice="get_wind", max_tokens=4)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("chat.tool_choice.function.name='get_wind': not among the tools")


def test_the_client_command_sends_tools(served, tmp_path, capsys):
    from jaxinfer.cli import main

    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER, TIME]))
    argv = ["client", "--server", served.grpc, "generate", "--chat", ASK[0]["content"], "--tools", str(tools),
            "--tool-choice", "get_time", "--max-tokens", "40", "--temperature", "0", "--output-format", "jsonl"]
    assert main(argv) == 0
    last = json.loads(capsys.readouterr().out.splitlines()[-1])
    (call,) = last["outputs"][0]["tool_calls"]
    assert call["name"] == "get_time" and set(json.loads(call["arguments"])) == {"city"}
    assert main([*argv[:6], "--tools", "[oops"]) == 2
    assert "--tools '[oops': neither a file nor a JSON list" in capsys.readouterr().err
