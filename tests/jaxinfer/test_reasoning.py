"""A reasoning model's thinking split from its answer (jaxinfer.tokenizer.reasoning), whole and
streamed (a stream cut anywhere adds up to the whole split), and template variables."""

import random

import pytest

from jaxinfer.tokenizer.chat_template import check_template_kwargs, render_chat_template
from jaxinfer.tokenizer.reasoning import reasoning_parser

CASES = [
    ("qwen3", "<think>\nLet me think.\nOK.\n</think>\n\nParis.", ("Let me think.\nOK.", "Paris.")),
    ("qwen3", "Paris.", (None, "Paris.")),  # thinking switched off: no reasoning
    ("qwen3", "  <think>x</think>y", ("x", "y")),
    ("qwen3", "<thi", (None, "<thi")),  # not the marker after all
    ("qwen3", "<think>\ncut short by max_tokens  ", ("cut short by max_tokens", "")),
    ("qwen3", "<think>\n\n</think>\n\nA", (None, "A")),  # empty reasoning is none
    ("qwen3", "Paris </think> x", (None, "Paris </think> x")),  # an end marker without a start
    ("deepseek_r1", "Reasoning here.\n</think>\n\nAnswer", ("Reasoning here.", "Answer")),  # opened by the prompt
    ("deepseek_r1", "<think>\nR\n</think>A", ("R", "A")),
    ("deepseek_r1", "still thinking", ("still thinking", "")),
    ("deepseek_r1", "</think>A", (None, "A")),
]


@pytest.mark.parametrize("name, text, expected", CASES)
def test_split(name, text, expected):
    assert reasoning_parser(name).split(text) == expected


@pytest.mark.parametrize("name, text, expected", CASES)
def test_a_stream_cut_anywhere_adds_up_to_the_split(name, text, expected):
    rng = random.Random(0)
    for cut in range(8):
        stream, thought, content, pos = reasoning_parser(name).stream(), "", "", 0
        while pos < len(text):
            step = 1 if cut == 0 else rng.randint(1, 7)
            r, c = stream.feed(text[pos : pos + step])
            thought, content, pos = thought + r, content + c, pos + step
            assert "</think>" not in thought and not (thought and thought[0].isspace())
        r, c = stream.finish()
        assert ((thought + r) or None, content + c) == expected


def test_reasoning_is_shown_as_it_comes():
    stream = reasoning_parser("qwen3").stream()
    assert stream.feed("<think>\nFirst") == ("First", "")
    assert stream.feed(" step.\n</thi") == (" step.", "")  # the newline and a half marker wait
    assert stream.feed("nk>\n\nAnswer") == ("", "Answer")


def test_unknown_parser_and_template_variables():
    with pytest.raises(ValueError, match="reasoning_parser='r1': unknown; choose one of deepseek_r1, qwen3"):
        reasoning_parser("r1")
    template = "{% if enable_thinking is false %}no-think {% endif %}{{ messages[0].content }}"
    kwargs = check_template_kwargs({"enable_thinking": False})
    assert render_chat_template(template, [{"role": "user", "content": "hi"}], **kwargs) == "no-think hi"
    assert check_template_kwargs(None) == {}
    with pytest.raises(ValueError, match=r"chat_template_kwargs\['tools'\]: set by the request itself"):
        check_template_kwargs({"tools": []})
    with pytest.raises(ValueError, match="chat_template_kwargs=\\[1\\]: must be an object"):
        check_template_kwargs([1])
