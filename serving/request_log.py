"""The request log: one JSON line per finished generation request, on both transports.

    record = request_log.start("http", "/v1/completions", key_id)  # when the request arrives
    record.request_id, record.user, record.prompt_tokens = ...      # once the request is parsed
    if record.keep_text: record.prompt = ...   # as sent; only with log_prompts
    record.observe(prompt_index, delta)   # each delta: usage, first token, finish reasons, text
    request_log.finish(record, status)    # one line, success or error

`--request-log FILE` appends to FILE (`-`: stderr) through a logger of its own that no other
handler sees. Fields: time (arrival, UTC ISO 8601), request_id, transport (http / grpc), route
(HTTP path or gRPC method), key_id (the sha256 prefix; never a key or token), model, status (HTTP
status or gRPC code name), prompt_tokens, completion_tokens, ttft_s, e2e_s, finish_reasons, user
(when given), lora_adapter (the LoRA adapter it ran under, when one), error (when refused or
failed). With log_prompts: prompt and outputs too, and the whole error message; without, an
INVALID_ARGUMENT's message is cut to the field it names, since messages may quote the request's
content.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import re
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxinfer.outputs import RequestOutput

_INPUT_ERRORS = (400, "INVALID_ARGUMENT")  # their messages may quote the request


@dataclasses.dataclass
class RequestRecord:
    transport: str
    route: str
    key_id: str | None
    started: float  # the log's clock (monotonic)
    wall_time: float  # time.time() at arrival
    keep_text: bool = False  # collect the prompt and the outputs' text (log_prompts)
    clock: Callable[[], float] = time.monotonic
    request_id: str | None = None
    user: str | None = None
    lora_adapter: str | None = None  # the LoRA adapter it runs under
    prompt: object = None  # the prompt as sent; set only when keep_text
    prompt_tokens: int = 0
    error: str | None = None
    status: int | str | None = None  # HTTP: set when the response starts
    first_token: float | None = None
    _completion: dict[int, int] = dataclasses.field(default_factory=dict)  # prompt -> tokens so far
    _finish: dict[tuple[int, int], str] = dataclasses.field(default_factory=dict)
    _texts: dict[tuple[int, int], list[str]] = dataclasses.field(default_factory=dict)
    _ids: dict[tuple[int, int], list[int]] = dataclasses.field(default_factory=dict)

    def observe(self, prompt_index: int, delta: RequestOutput) -> None:
        """One delta of the engine request of prompt `prompt_index` (usage is cumulative)."""
        now = self.clock()
        self._completion[prompt_index] = delta.usage.completion_tokens
        for c in delta.outputs:
            where = (prompt_index, c.index)
            if c.token_ids and self.first_token is None:
                self.first_token = now
            if c.finish_reason is not None:
                self._finish[where] = c.finish_reason
            if self.keep_text:
                self._texts.setdefault(where, []).append(c.text)
                self._ids.setdefault(where, []).extend(c.token_ids)

    @property
    def completion_tokens(self) -> int:
        return sum(self._completion.values())

    @property
    def total_tokens(self) -> int:
        """Prompt and generated tokens: what a tokens-per-minute limit settles on."""
        return self.prompt_tokens + self.completion_tokens

    def fields(self, model: str, status: int | str | None, now: float, log_prompts: bool) -> dict:
        time_iso = datetime.datetime.fromtimestamp(self.wall_time, datetime.UTC)
        out: dict[str, Any] = {
            "time": time_iso.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "request_id": self.request_id,
            "transport": self.transport,
            "route": self.route,
            "key_id": self.key_id,
            "model": model,
            "status": status,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "ttft_s": None if self.first_token is None else round(self.first_token - self.started, 6),
            "e2e_s": round(now - self.started, 6),
            "finish_reasons": [self._finish[k] for k in sorted(self._finish)],
        }
        if self.user is not None:
            out["user"] = self.user
        if self.lora_adapter is not None:
            out["lora_adapter"] = self.lora_adapter
        if self.error is not None:
            out["error"] = self.error if log_prompts or status not in _INPUT_ERRORS else _field_of(self.error)
        if log_prompts:
            out["prompt"] = self.prompt
            texts = ["".join(self._texts[k]) for k in sorted(self._texts)]
            out["outputs"] = texts if any(texts) else [self._ids[k] for k in sorted(self._ids)]
        return out


def _field_of(message: str) -> str:
    """`temperature=-1: must be ...` -> `temperature: invalid (...)`: the field, not the value."""
    field = (m.group(0) if (m := re.match(r"[\w.\[\]]*", message)) else "") or "request"
    return f"{field}: invalid (the message is logged with --log-prompts)"


class RequestLog:
    """Where records go; without a target, start() still gives records and finish() writes none."""

    def __init__(
        self,
        target: str | None = None,
        log_prompts: bool = False,
        model: str = "",
        clock: Callable[[], float] = time.monotonic,
    ):
        self.target, self.log_prompts, self.model, self.clock = target, log_prompts, model, clock
        self._logger = logging.Logger("serving.request_log", logging.INFO)  # not in the global hierarchy
        self._handler: logging.Handler | None = None
        if target is not None:
            self._handler = (
                logging.StreamHandler(sys.stderr)
                if target == "-"
                else logging.FileHandler(target, mode="a", encoding="utf-8")
            )
            self._handler.setFormatter(logging.Formatter("%(message)s"))
            self._logger.addHandler(self._handler)

    @property
    def enabled(self) -> bool:
        return self._handler is not None

    def start(self, transport: str, route: str, key_id: str | None = None) -> RequestRecord:
        return RequestRecord(
            transport, route, key_id, self.clock(), time.time(), keep_text=self.log_prompts, clock=self.clock
        )

    def finish(self, record: RequestRecord, status: int | str | None) -> None:
        if self._handler is None:
            return
        fields = record.fields(self.model, status, self.clock(), self.log_prompts)
        self._logger.info(json.dumps(fields, ensure_ascii=False, default=str))

    def close(self) -> None:
        if self._handler is not None:
            self._logger.removeHandler(self._handler)
            self._handler.close()
            self._handler = None
