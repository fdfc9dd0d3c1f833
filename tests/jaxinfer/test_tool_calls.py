"""Tool calls read out of model text (jaxinfer.tokenizer.tool_calls): each format's calls, text
that is no call kept as content, the format a chat template shows, and chat templates given as
a file or as text."""

import json

import pytest
from testpaths import FIXTURES

from jaxinfer.tokenizer.chat_template import ChatTemplateError, load_chat_template, render_chat_template
from jaxinfer.tokenizer.tool_calls import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ParsedText,
    ToolCall,
    parser_for_template,
    resolve_parser,
    tool_call_parser,
)

HERMES_TEMPLATE = FIXTURES / "templates" / "hermes_tools.jinja"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def calls(*pairs) -> tuple[ToolCall, ...]:
    return tuple(ToolCall(name, json.dumps(args)) for name, args in pairs)


@pytest.mark.parametrize(
    "text, expected",
    [
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', ParsedText(None, calls(("f", {"a": 1})))),
        (
            'Let me look.\n\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n'
            '{"name": "g", "arguments": "{\\"b\\": [2]}"}\n</tool_call>',
            ParsedText("Let me look.", calls(("f", {"a": 1}), ("g", {"b": [2]}))),
        ),
        # an unclosed last call that is whole JSON (the model stopped at its end-of-turn token)
        ('<tool_call>{"name": "f", "arguments": {}}', ParsedText(None, calls(("f", {})))),
        # a block that is no call stays in the content, beside the one that is
        (
            '<tool_call>{"name": "f"</tool_call> then <tool_call>{"name": "g", "arguments": {}}</tool_call>',
            ParsedText('<tool_call>{"name": "f"</tool_call> then', calls(("g", {}))),
        ),
        (
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
            ParsedText('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', ()),
        ),
        ("No tools needed:  ", ParsedText("No tools needed:  ", ())),
        ("", ParsedText(None, ())),
    ],
)
def test_hermes(text, expected):
    assert HermesParser().parse(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"name": "f", "parameters": {"x": "y"}}', ParsedText(None, calls(("f", {"x": "y"})))),
        (
            ' {"name": "f", "parameters": {}}; {"name": "g", "arguments": {"k": 1}}',
            ParsedText(None, calls(("f", {}), ("g", {"k": 1}))),
        ),
        ('<|python_tag|>{"name": "f", "parameters": {"q": 2}}', ParsedText(None, calls(("f", {"q": 2})))),
        ('{"name": "f", "parameters": {}} and more', ParsedText('{"name": "f", "parameters": {}} and more', ())),
        ('{"not": "a call"}', ParsedText('{"not": "a call"}', ())),
        ('The answer is {"name": "f"}', ParsedText('The answer is {"name": "f"}', ())),
    ],
)
def test_llama3_json(text, expected):
    assert Llama3JsonParser().parse(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            '[TOOL_CALLS][{"name": "f", "arguments": {"q": 1}}, {"name": "g", "arguments": {}}]',
            ParsedText(None, calls(("f", {"q": 1}), ("g", {}))),
        ),
        ('[TOOL_CALLS]f[ARGS]{"q": 1}[TOOL_CALLS]g[ARGS]{}', ParsedText(None, calls(("f", {"q": 1}), ("g", {})))),
        ('Sure. [TOOL_CALLS][{"name": "f", "arguments": {}}]', ParsedText("Sure.", calls(("f", {})))),
        ("[TOOL_CALLS][{broken", ParsedText("[TOOL_CALLS][{broken", ())),
    ],
)
def test_mistral(text, expected):
    assert MistralParser().parse(text) == expected


def test_a_streamed_prefix_never_shows_half_a_marker():
    parser = HermesParser()
    assert parser.safe_length("Hello <tool_") == len("Hello")
    assert parser.safe_length("Hello <b>") == len("Hello <b>")
    assert parser.safe_length("Hello \n") == len("Hello")  # trailing whitespace waits: it may precede a call
    assert parser.closed_end('a<tool_call>{}</tool_call><tool_call>{"na') == len("a<tool_call>{}</tool_call>")
    assert Llama3JsonParser().find("  {") == 2 and Llama3JsonParser().find("x {") == -1


def test_parsers_by_name_and_by_template():
    assert isinstance(tool_call_parser("hermes"), HermesParser)
    with pytest.raises(ValueError, match="tool_call_parser='xml': unknown; choose one of hermes, llama3_json, mistral"):
        tool_call_parser("xml")
    assert isinstance(parser_for_template(HERMES_TEMPLATE.read_text()), HermesParser)
    assert isinstance(parser_for_template("{{ '[TOOL_CALLS]' }}"), MistralParser)
    assert isinstance(parser_for_template("{{ '<|python_tag|>' }}"), Llama3JsonParser)
    assert parser_for_template((FIXTURES / "smollm2" / "chat_template.jinja").read_text()) is None
    assert parser_for_template(None) is None
    assert resolve_parser("none", HERMES_TEMPLATE.read_text()) is None
    assert isinstance(resolve_parser("auto", HERMES_TEMPLATE.read_text()), HermesParser)
    assert isinstance(resolve_parser("mistral", None), MistralParser)


def test_chat_templates_from_a_file_or_text(tmp_path):
    text = load_chat_template(str(HERMES_TEMPLATE))
    assert text == HERMES_TEMPLATE.read_text()
    assert load_chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"
    with pytest.raises(ChatTemplateError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ChatTemplateError, match=r"chat_template='\{% for %\}'.*does not compile"):
        load_chat_template("{% for %}")


def test_the_template_renders_tools_calls_and_results():
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18C, sunny"},
    ]
    text = render_chat_template(HERMES_TEMPLATE.read_text(), messages, tools=[WEATHER])
    assert json.dumps(WEATHER["function"]) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n18C, sunny\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    # written back the way it reads: the parser finds the call the template wrote
    call = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert HermesParser().parse(call) == ParsedText(None, calls(("get_weather", {"city": "Paris"})))
