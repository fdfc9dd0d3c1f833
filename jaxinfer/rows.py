"""Requests as rows of a batch job, and their results as records: one reading for every batch path.

    parse_line(text, lineno, defaults, llm)   a `jaxinfer batch` JSONL line (sampling fields flat)
    parse_row(row, where, defaults, llm)       a Ray Data row (sampling fields under "sampling_params",
                                               as ray.data.llm rows carry them; other columns pass)
    record_of(id, output)                      a finished request's output line

Both readings give (id, prompt or token ids, SamplingParams, LoRARequest | None), or a ValueError
naming the problem (and the line or row it is in). Chats are rendered with the model's template.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

from jaxinfer.lora.request import LoRARequest
from jaxinfer.outputs import logprobs_json
from jaxinfer.sampling.params import SamplingParams, StructuredOutput, check_logit_bias_vocab, logit_bias_from_json

if TYPE_CHECKING:
    from jaxinfer.llm import LLM
    from jaxinfer.outputs import RequestOutput

FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
REQUEST_FIELDS = frozenset({"prompt", "prompt_token_ids", "messages", "tools", "chat_template_kwargs", "lora"})
Parsed = tuple[str, str | list[int], SamplingParams, LoRARequest | None]


def parse_line(line: str, lineno: int, defaults: SamplingParams, llm: LLM | None) -> Parsed:
    """A JSONL line: {"id", one of prompt / prompt_token_ids / messages, SamplingParams fields, ...}."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"line {lineno}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise ValueError(f"line {lineno}: not valid JSON (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise ValueError(f"line {lineno}: expected a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - FIELDS - REQUEST_FIELDS - {"id"}
    if unknown:
        raise ValueError(f"line {lineno}: unknown fields {sorted(unknown)}")
    sampling = {k: v for k, v in obj.items() if k in FIELDS}
    return str(obj.get("id", lineno)), *_request(obj, sampling, f"line {lineno}", defaults, llm)


def parse_row(row: dict[str, Any], where: str, defaults: SamplingParams, llm: LLM | None) -> Parsed:
    """A Ray Data row: the request fields, "sampling_params" (a dict of SamplingParams fields) and
    any other columns, which the caller carries through. The id is the row's "id" when it has one."""
    sampling = row.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise ValueError(f"{where}: sampling_params must be a mapping, got {type(sampling).__name__}")
    unknown = set(sampling) - FIELDS
    if unknown:
        raise ValueError(f"{where}: sampling_params: unknown fields {sorted(unknown)}")
    request = {k: v for k, v in row.items() if k in REQUEST_FIELDS and v is not None}
    return str(row.get("id", where)), *_request(request, sampling, where, defaults, llm)


def _request(
    obj: dict[str, Any], sampling: dict[str, Any], where: str, defaults: SamplingParams, llm: LLM | None
) -> tuple[str | list[int], SamplingParams, LoRARequest | None]:
    sources = [k for k in ("prompt", "prompt_token_ids", "messages") if k in obj]
    if len(sources) != 1:
        raise ValueError(f"{where}: give exactly one of prompt, prompt_token_ids, messages")
    for key in ("tools", "chat_template_kwargs"):
        if key in obj and "messages" not in obj:
            raise ValueError(f"{where}: {key}: only with messages (the chat template takes them)")
    prompt: str | list[int]
    if "messages" in obj:
        if llm is None:
            raise ValueError(f"{where}: messages need a model's chat template")
        prompt = llm.render_chat(
            obj["messages"], tools=obj.get("tools"), chat_template_kwargs=obj.get("chat_template_kwargs")
        )
    elif "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise ValueError(f"{where}: prompt must be a string")
        prompt = obj["prompt"]
    else:
        prompt = obj["prompt_token_ids"]
        if not isinstance(prompt, list):
            raise ValueError(f"{where}: prompt_token_ids must be a list of integers")
    overrides: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in sampling.items()}
    try:
        if isinstance(overrides.get("structured_output"), dict):  # {"json": {...}} / {"regex": "..."} ...
            overrides["structured_output"] = StructuredOutput(**overrides["structured_output"])
        if "logit_bias" in overrides:  # {"50256": -100}: JSON keys are strings
            overrides["logit_bias"] = logit_bias_from_json(overrides["logit_bias"])
        params = dataclasses.replace(defaults, **overrides)
        if llm is not None:  # ids against the vocabulary, before the request is read ahead
            check_logit_bias_vocab(params, llm.engine.model.config.vocab_size)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from None
    return prompt, params, _lora(obj.get("lora"), where)


def _lora(spec: Any, where: str) -> LoRARequest | None:
    """A request's "lora": an adapter's name, or {"name": ..., "path": ...}; None: the base model."""
    if spec is None:
        return None
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, dict) or set(spec) - {"name", "path"} or not isinstance(spec.get("name"), str):
        raise ValueError(f'{where}: lora must be an adapter name or {{"name": ..., "path": ...}}, got {spec!r}')
    path = spec.get("path", "")
    if not isinstance(path, str):
        raise ValueError(f"{where}: lora path must be a string, got {path!r}")
    return LoRARequest(spec["name"], 1, path)


def line_error(e: Exception, lineno: int) -> str:
    """A line's failure as its output line's "error": the line's number first."""
    message = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
    return message if message.startswith("line") else f"line {lineno}: {message}"


def record_of(rid: str, out: RequestOutput) -> dict:
    """A finished request's output line: its outputs (with their logprobs when the request asked
    for them), usage, and its prompt's logprobs when asked for."""
    outputs = [
        {
            "text": c.text,
            "token_ids": c.token_ids,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
            **({} if c.logprobs is None else {"logprobs": logprobs_json(c.logprobs)}),
        }
        for c in out.outputs
    ]
    record: dict[str, Any] = {"id": rid, "outputs": outputs, "usage": dataclasses.asdict(out.usage)}
    if out.prompt_logprobs is not None:
        record["prompt_logprobs"] = logprobs_json(out.prompt_logprobs)
    return record
