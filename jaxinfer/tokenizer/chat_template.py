"""Chat templates: the checkpoint's jinja2 template turning messages into one prompt string.

Rendered the way HF transformers renders them, so a prompt matches what the model was tuned on:
a sandboxed environment (templates come from model repos and are untrusted) with trim_blocks and
lstrip_blocks, the loopcontrols extension, `raise_exception(msg)`, `strftime_now(fmt)`, a `tojson`
filter that does not HTML-escape, and `{% generation %}` blocks (HF's assistant-mask marker)
rendered as their plain body. Variables: messages, add_generation_prompt, bos_token, eos_token,
unk_token, pad_token, tools, documents, plus whatever the caller passes.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A template that does not compile, or that raised while rendering (raise_exception)."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,  # a template's value: JSON-like
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile (line {e.lineno}): {e.message}") from e


def load_chat_template(value: str) -> str:
    """A chat template given as a file's path or as the template itself (vLLM's --chat-template),
    compiled once to check it; ChatTemplateError naming the value otherwise."""
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            value = f.read()
    elif "{" not in value:
        raise ChatTemplateError(f"chat_template={value!r:.120}: no such file, and no template text")
    try:
        _compile(value)
    except ChatTemplateError as e:
        raise ChatTemplateError(f"chat_template={value!r:.60}: {e}") from None
    return value


RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "documents"})


def check_template_kwargs(kwargs: object) -> dict:
    """Extra variables a caller hands the chat template (vLLM's `chat_template_kwargs`, e.g.
    {"enable_thinking": False}); ValueError naming a bad one."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"chat_template_kwargs={kwargs!r:.80}: must be an object of named values")
    taken = sorted(RESERVED & set(kwargs))
    if taken:
        raise ValueError(f"chat_template_kwargs[{taken[0]!r}]: set by the request itself, not here")
    return kwargs


def render_chat_template(
    template: str, messages: list[dict], *, add_generation_prompt: bool = True, **variables: Any
) -> str:
    """The prompt text for `messages` ([{"role": ..., "content": ...}, ...])."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ChatTemplateError(f"messages must be a list of dicts, got {messages!r}")
    context = {"tools": None, "documents": None, **variables}
    try:
        return _compile(template).render(
            messages=copy.deepcopy(messages), add_generation_prompt=add_generation_prompt, **context
        )
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from e


def check_messages(messages: object) -> None:
    """ValueError naming the first malformed part of a conversation."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages={messages!r:.80}: must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}]={m!r:.80}: must be an object with role and content")
        if not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}].role={m.get('role')!r:.80}: must be a string")
        calls = m.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            raise ValueError(f"messages[{i}].tool_calls={calls!r:.80}: must be a list of tool call objects")
        if not isinstance(m.get("content"), str) and not (calls and m.get("content") is None):
            raise ValueError(
                f"messages[{i}].content={m.get('content')!r:.80}: must be a string (or None beside tool_calls)"
            )
