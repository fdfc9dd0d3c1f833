"""Chat messages -> the chat template's prompt (token ids), for /v1/chat/completions and
/tokenize: text content (parts joined), an assistant's tool_calls with their arguments decoded,
a tool result's tool_call_id, the request's tools and chat_template_kwargs. Every problem is a
400 naming the request's field (`messages[2].tool_calls[0].function.arguments`).
"""

from __future__ import annotations

from typing import Any

from jaxinfer.tokenizer import Tokenizer
from jaxinfer.tokenizer.chat_template import check_template_kwargs
from serving.openai.errors import bad_request, named_400
from serving.openai.protocol import ChatMessage
from serving.tools import checked_tools, template_call


def render_messages(
    messages: list[ChatMessage],
    tokenizer: Tokenizer | None,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
) -> list[int]:
    """The chat template's prompt as token ids (the template writes BOS and role markers);
    `tools` checked already (tool_request, template_tools)."""
    try:
        extra = check_template_kwargs(template_kwargs)
    except ValueError as e:
        raise bad_request("chat_template_kwargs", str(e)) from None
    if not messages:
        raise bad_request("messages", "messages: empty")
    if tokenizer is None:
        raise bad_request("messages", "messages: this model has no tokenizer; send token ids to /v1/completions")
    if getattr(tokenizer, "chat_template", None) is None:
        raise bad_request("messages", "messages: this model has no chat template; use /v1/completions")
    plain = [_template_message(m, i) for i, m in enumerate(messages)]
    try:
        text = tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt, tools=tools, **extra)
    except Exception as e:  # a template may raise on roles or orders it does not know
        raise bad_request("messages", f"messages: the chat template rejected them: {e}") from None
    return tokenizer.encode(text, add_special_tokens=False)


def template_tools(tools: object) -> list[dict] | None:
    """A request's tools for the template alone (/tokenize), checked as a chat's are."""
    with named_400():
        return None if tools is None else checked_tools(tools)


def _template_message(message: ChatMessage, i: int) -> dict:
    """A message as chat templates read it: text content, an assistant's tool_calls, a tool
    message's tool_call_id and name."""
    entry: dict[str, Any] = {"role": message.role}
    if message.content is None and message.role == "assistant" and message.tool_calls:
        entry["content"] = ""
    else:
        entry["content"] = _message_text(message, i)
    if message.tool_calls:
        with named_400():
            entry["tool_calls"] = [
                template_call(call, f"messages[{i}].tool_calls[{j}]") for j, call in enumerate(message.tool_calls)
            ]
    for key in ("tool_call_id", "name"):
        if getattr(message, key) is not None:
            entry[key] = getattr(message, key)
    return entry


def _message_text(message: ChatMessage, i: int) -> str:
    if message.content is None:
        raise bad_request(
            f"messages[{i}].content",
            f"messages[{i}].content: required (an assistant message may leave it out when it has tool_calls)",
        )
    if isinstance(message.content, str):
        return message.content
    texts = []
    for j, part in enumerate(message.content):
        if part.type != "text" or part.text is None:
            raise bad_request(
                f"messages[{i}].content[{j}].type",
                f"messages[{i}].content[{j}].type={part.type!r}: only text parts are supported",
            )
        texts.append(part.text)
    return "\n".join(texts)
