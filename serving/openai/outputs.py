"""RequestOutputs -> OpenAI response bodies: whole responses, and streamed chunks.

Choice indices: prompt p's sample j is choice `p * n + j` (OpenAI's order for a batch of
prompts). A stream, per choice: (chat) a chunk with `delta.role`, then content chunks, then one
chunk with an empty delta and the finish_reason; then, with include_usage, one chunk with no
choices and the usage. Every chunk of a stream carries the same id and `created`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any

from jaxinfer.outputs import CompletionOutput, Logprob, RequestOutput
from jaxinfer.tokenizer import Tokenizer
from jaxinfer.tokenizer.reasoning import ReasoningParser
from serving.openai import tools as openai_tools
from serving.tools import ToolRequest

MIN_LOGPROB = -9999.0  # JSON has no -inf


@dataclasses.dataclass(frozen=True)
class PromptShown:
    """How a response shows a request's prompt logprobs: completions' echo with logprobs=N (the
    prompt's tokens lead each choice's logprobs, `echo_top` = N) and/or, for a request with
    `prompt_logprobs`, vLLM's `prompt_logprobs` field (per choice in completions, top level in chat)."""

    echo_top: int | None = None
    field: bool = False

    def field_of(self, out: RequestOutput, texts: TokenTexts) -> dict:
        """{"prompt_logprobs": [...]} once `out` carries them and the request asked for the field."""
        if not self.field or out.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": texts.prompt_entries(out)}


@dataclasses.dataclass
class ResponseHeader:
    id: str  # cmpl-... / chatcmpl-...
    object: str  # text_completion / chat.completion / chat.completion.chunk
    created: int
    model: str

    def body(self, **fields: Any) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model, **fields}


class TokenTexts:
    """Token id -> its text, for logprobs (cached; `token_id:N` without a tokenizer)."""

    def __init__(self, tokenizer: Tokenizer | None):
        self._tokenizer = tokenizer
        self.text = functools.lru_cache(maxsize=65536)(self._text)

    def _text(self, token_id: int) -> str:
        if self._tokenizer is None:
            return f"token_id:{token_id}"
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def chat_entry(self, lp: Logprob) -> dict:
        return {**self._entry(lp.token_id, lp.logprob), "top_logprobs": [self._entry(t, v) for t, v in _ranked(lp)]}

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.text(token_id)
        return {"token": text, "logprob": max(logprob, MIN_LOGPROB), "bytes": list(text.encode("utf-8"))}

    def completion_logprobs(self, logprobs: list[Logprob], offset: int) -> dict:
        """OpenAI's legacy shape; text offsets count from `offset` (the choice's text so far)."""
        tokens, offsets = [], []
        for lp in logprobs:
            offsets.append(offset)
            tokens.append(self.text(lp.token_id))
            offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [max(lp.logprob, MIN_LOGPROB) for lp in logprobs],
            "top_logprobs": [{self.text(t): max(v, MIN_LOGPROB) for t, v in lp.top.items()} for lp in logprobs],
            "text_offset": offsets,
        }

    def echo_logprobs(self, out: RequestOutput, top: int) -> dict:
        """Completions' echo with logprobs: the legacy shape over the prompt's tokens (the first
        has none: nothing predicts it), each with its `top` most likely tokens."""
        tokens = [self.text(t) for t in out.prompt_token_ids]
        scored = list(filter(None, (out.prompt_logprobs or [None])[1:]))  # the first is None
        tops = [{self.text(t): max(v, MIN_LOGPROB) for t, v in _ranked(lp)[:top]} for lp in scored]
        return {
            "tokens": tokens,
            "token_logprobs": [None, *[max(lp.logprob, MIN_LOGPROB) for lp in scored]],
            "top_logprobs": [None, *tops],
            "text_offset": list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0)),
        }

    def prompt_entries(self, out: RequestOutput) -> list[dict | None]:
        """vLLM's `prompt_logprobs`: per prompt token, None (the first) or {token id: {"logprob",
        "rank", "decoded_token"}} for the token itself and the most likely ones."""
        entries: list[dict | None] = [None]
        for lp in filter(None, (out.prompt_logprobs or [None])[1:]):
            entry = {str(t): self._ranked_entry(t, v, rank) for rank, (t, v) in enumerate(_ranked(lp), start=1)}
            entry[str(lp.token_id)] = self._ranked_entry(lp.token_id, lp.logprob, lp.rank)
            entries.append(entry)
        return entries

    def _ranked_entry(self, token_id: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": max(logprob, MIN_LOGPROB), "rank": rank, "decoded_token": self.text(token_id)}


def _ranked(lp: Logprob) -> list[tuple[int, float]]:
    """A position's top tokens, most likely first."""
    return sorted(lp.top.items(), key=lambda kv: -kv[1])


def _joined(first: dict, then: dict) -> dict:
    """Two legacy logprobs objects as one (the echoed prompt's, then the completion's)."""
    return {key: first[key] + then[key] for key in first}


def usage(results: list[RequestOutput]) -> dict:
    """OpenAI's usage object; `host_cached_tokens`: of the cached tokens, those from host memory."""
    prompt, completion = sum(r.usage.prompt_tokens for r in results), sum(r.usage.completion_tokens for r in results)
    cached = {"cached_tokens": sum(r.usage.cached_prompt_tokens for r in results)}
    cached["host_cached_tokens"] = sum(r.usage.host_cached_prompt_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion} | {
        "prompt_tokens_details": cached
    }


def completion_response(
    head: ResponseHeader,
    results: list[RequestOutput],
    n: int,
    texts: TokenTexts,
    echo: list[str] | None = None,
    shown: PromptShown = PromptShown(),
) -> dict:
    choices = []
    for p, result in enumerate(results):
        prefix = echo[p] if echo else ""
        for c in result.outputs:
            lps = None if c.logprobs is None else texts.completion_logprobs(c.logprobs, len(prefix))
            if lps is not None and shown.echo_top is not None and result.prompt_logprobs is not None:
                lps = _joined(texts.echo_logprobs(result, shown.echo_top), lps)
            choices.append(
                {
                    "index": p * n + c.index,
                    "text": prefix + c.text,
                    "logprobs": lps,
                    "finish_reason": c.finish_reason,
                    **shown.field_of(result, texts),
                }
            )
    return head.body(choices=choices, usage=usage(results))


def chat_response(
    head: ResponseHeader,
    result: RequestOutput,
    texts: TokenTexts,
    tools: ToolRequest | None = None,
    reasoning: ReasoningParser | None = None,
    shown: PromptShown = PromptShown(),
) -> dict:
    """`tools`: the request's tool choice, whose calls are read out of each choice's text;
    `reasoning`: the server's reasoning parser, which splits `reasoning_content` off first."""
    choices = []
    for c in result.outputs:
        message, reason = openai_tools.message(tools, c.text, c.finish_reason, reasoning)
        choices.append(
            {
                "index": c.index,
                "message": message,
                "finish_reason": reason,
                "logprobs": None if c.logprobs is None else {"content": [texts.chat_entry(lp) for lp in c.logprobs]},
            }
        )
    return head.body(choices=choices, usage=usage([result]), **shown.field_of(result, texts))


class ChunkWriter:
    """The chunks of one streamed response, delta by delta."""

    def __init__(
        self,
        head: ResponseHeader,
        n: int,
        texts: TokenTexts,
        include_usage: bool,
        echo: list[str] | None = None,
        tools: ToolRequest | None = None,
        reasoning: ReasoningParser | None = None,
        shown: PromptShown = PromptShown(),
    ):
        self.head, self.n, self.texts, self.include_usage = head, n, texts, include_usage
        self.chat = head.object == "chat.completion.chunk"
        self._echo, self._tools, self._reasoning, self._shown = echo, tools, reasoning, shown
        self._read = self.chat and (tools is not None or reasoning is not None)
        self._streams: dict[int, openai_tools.ChoiceStream] = {}  # choice -> its text read as it comes
        self._offsets: dict[int, int] = {}  # choice -> characters streamed (completions' text_offset)
        self._finished: set[int] = set()

    def _chunk(
        self, index: int, finish_reason: str | None = None, logprobs: dict | None = None, **content: Any
    ) -> dict:
        choice = {"index": index, **content, "logprobs": logprobs, "finish_reason": finish_reason}
        extra = {"usage": None} if self.include_usage else {}
        return self.head.body(choices=[choice], **extra)

    def opening(self, num_prompts: int) -> list[dict]:
        """Chat: the assistant role of every choice; completions with echo: each prompt's text
        (with logprobs: once the prompt's logprobs come, `_prompt_chunks`)."""
        if self.chat:
            return [self._chunk(i, delta={"role": "assistant", "content": ""}) for i in range(self.n)]
        if not self._echo or self._shown.echo_top is not None:
            return []
        chunks = []
        for p in range(num_prompts):
            for j in range(self.n):
                self._offsets[p * self.n + j] = len(self._echo[p])
                chunks.append(self._chunk(p * self.n + j, text=self._echo[p]))
        return chunks

    def deltas(self, prompt: int, out: RequestOutput) -> list[dict]:
        chunks = self._prompt_chunks(prompt, out) if out.prompt_logprobs is not None else []
        for c in out.outputs:
            index = prompt * self.n + c.index
            if index in self._finished:
                continue
            if self._read:
                chunks.extend(self._read_chunks(index, c))
                continue
            if c.text or c.logprobs:
                chunks.append(self._content(index, c))
            if c.finish_reason is not None:
                self._finished.add(index)
                ending: dict[str, Any] = {"delta": {}} if self.chat else {"text": ""}
                chunks.append(self._chunk(index, c.finish_reason, **ending))
        return chunks

    def _prompt_chunks(self, prompt: int, out: RequestOutput) -> list[dict]:
        """The prompt's logprobs, in the first delta after the prompt was computed: completions'
        echoed prompt with its logprobs, and/or the `prompt_logprobs` field (chat: in a chunk
        without choices)."""
        field = self._shown.field_of(out, self.texts)
        if self.chat:
            return (
                [self.head.body(choices=[], **field, **({"usage": None} if self.include_usage else {}))]
                if field
                else []
            )
        chunks = []
        for index in range(prompt * self.n, (prompt + 1) * self.n):
            if self._shown.echo_top is not None and self._echo is not None:  # echo_top: with echo
                self._offsets[index] = len(self._echo[prompt])
                lps = self.texts.echo_logprobs(out, self._shown.echo_top)
                chunks.append(self._chunk(index, logprobs=lps, text=self._echo[prompt], **field))
            elif field:
                chunks.append(self._chunk(index, text="", **field))
        return chunks

    def _read_chunks(self, index: int, c: CompletionOutput) -> list[dict]:
        """Chat read for reasoning and/or tools: reasoning, the content that cannot start a call,
        tool_call deltas, and the finish (finish_reason "tool_calls" when the choice made calls)."""
        stream = self._streams.setdefault(index, openai_tools.ChoiceStream(self._tools, self._reasoning))
        thought, content, calls = stream.feed(c.text, c.finish_reason is not None)
        lps = None if c.logprobs is None else {"content": [self.texts.chat_entry(lp) for lp in c.logprobs]}
        deltas = [
            d
            for d in (
                {"reasoning_content": thought} if thought else None,
                {"content": content} if content else None,
                {"tool_calls": calls} if calls else None,
            )
            if d
        ]
        if c.logprobs and not deltas:  # new tokens whose text is held back: their logprobs go now
            deltas = [{"content": ""}]
        chunks = [self._chunk(index, logprobs=lps if i == 0 else None, delta=d) for i, d in enumerate(deltas)]
        if c.finish_reason is not None:
            self._finished.add(index)
            reason = openai_tools.finish_reason_of(self._tools, c.finish_reason, stream.made_calls)
            chunks.append(self._chunk(index, reason, delta={}))
        return chunks

    def _content(self, index: int, c: CompletionOutput) -> dict:
        if self.chat:
            lps = None if c.logprobs is None else {"content": [self.texts.chat_entry(lp) for lp in c.logprobs]}
            return self._chunk(index, logprobs=lps, delta={"content": c.text})
        offset = self._offsets.get(index, 0)
        lps = None if c.logprobs is None else self.texts.completion_logprobs(c.logprobs, offset)
        self._offsets[index] = offset + len(c.text)
        return self._chunk(index, logprobs=lps, text=c.text)

    def closing(self, results: list[RequestOutput]) -> list[dict]:
        return [self.head.body(choices=[], usage=usage(results))] if self.include_usage else []
