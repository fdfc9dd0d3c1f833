"""A request's `kv_transfer_params` (disaggregated prefill/decode), read and checked once (no JAX).

vllm-router's P/D mode sends a prompt to a prefill server with `max_tokens=1` and
`{"do_remote_decode": true, ...}`, reads the top-level `kv_transfer_params` of its answer and
sends the request on to a decode server with those params (`do_remote_prefill: true`). The
answer of a jaxinfer prefill server (worker/kv_connector.py writes it) has vLLM's fields
(`remote_engine_id`, `remote_host`, `remote_port` of its side channel, `remote_block_ids`) and
what a pull needs:

    transfer_address   host:port of the prefill engine's transfer server
    transfer_ids       one id per transfer call (at most 64 pages each)
    widths             the pages each call moves (a power of two; the tail is padding)
    tables             per layer group, "1" for a page and "0" for none (a sliding window's past)
    num_tokens         the prompt tokens the pages hold
    prompt_hash        what the prompt's token ids hash to (a decode server with another prompt
                       or tokenizer computes the prompt itself)
    lora_name          the adapter the pages were computed under (None: the base model)
    layout             each cache's page shape and dtype

`parse_kv_transfer_params` returns None where the params ask nothing (no flag set, as vLLM
ignores them), else a KVTransferRequest; a malformed one raises RequestError naming the field.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from jaxinfer.core.requests import RequestError

FIELD = "kv_transfer_params"
MAX_ID = 2**63 - 1
_TICKET = (
    "remote_host",
    "remote_port",
    "transfer_address",
    "transfer_ids",
    "widths",
    "tables",
    "num_tokens",
    "prompt_hash",
    "layout",
)


@dataclasses.dataclass(frozen=True)
class KVTransferRequest:
    """What a request asks: `produce` (compute the prompt, hold its pages for a pull) or
    `consume` (pull the pages `ticket` describes, then decode)."""

    kind: str  # "produce" | "consume"
    ticket: dict[str, Any] | None = None  # consume: the prefill server's params, checked

    @property
    def num_pages(self) -> int:
        return sum(t.count("1") for t in self.ticket["tables"]) if self.ticket else 0


def prompt_hash(token_ids: list[int], lora_name: str | None) -> str:
    """The prompt's identity across servers: its token ids and the adapter it runs under."""
    digest = hashlib.sha256((lora_name or "").encode() + b"\0")
    digest.update(b"".join(int(t).to_bytes(4, "little") for t in token_ids))
    return digest.hexdigest()[:32]


def _bad(name: str, value: Any, why: str) -> RequestError:
    return RequestError(FIELD, f"{FIELD}.{name}={value!r}: {why}" if name else f"{FIELD}={value!r}: {why}")


def _int(params: dict, name: str, low: int, high: int) -> int:
    value = params[name]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _bad(name, value, f"expected an integer in [{low}, {high}]")
    return value


def _flag(params: dict, name: str) -> bool:
    value = params.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(name, value, "expected true or false")
    return value


def _check_ticket(params: dict[str, Any]) -> dict[str, Any]:
    missing = [name for name in _TICKET if params.get(name) is None]
    if missing:
        raise _bad(missing[0], None, "a decode request needs it (the prefill server's answer carries it)")
    for name in ("remote_host", "transfer_address", "prompt_hash"):
        if not isinstance(params[name], str) or not params[name]:
            raise _bad(name, params[name], "expected a non-empty string")
    host, _, port = params["transfer_address"].rpartition(":")
    if not host or not port.isdigit():
        raise _bad("transfer_address", params["transfer_address"], "expected HOST:PORT")
    _int(params, "remote_port", 1, 65535)
    _int(params, "num_tokens", 1, MAX_ID)
    ids, widths, tables = params["transfer_ids"], params["widths"], params["tables"]
    if not isinstance(ids, list) or not ids:
        raise _bad("transfer_ids", ids, "expected a non-empty list of integers")
    for i in range(len(ids)):
        _int({"transfer_ids": ids[i]}, "transfer_ids", 0, MAX_ID)
    if not isinstance(widths, list) or len(widths) != len(ids):
        raise _bad("widths", widths, f"expected a list of {len(ids)} widths, one per transfer id")
    for w in widths:
        if isinstance(w, bool) or not isinstance(w, int) or w < 1 or w & (w - 1):
            raise _bad("widths", widths, "each width must be a power of two")
    if (
        not isinstance(tables, list)
        or not tables
        or not all(isinstance(t, str) and set(t) <= {"0", "1"} for t in tables)
    ):
        raise _bad("tables", tables, 'expected a list of strings of "0" and "1", one per layer group')
    num_pages = sum(t.count("1") for t in tables)
    if not 0 < num_pages <= sum(widths) or sum(widths[:-1]) >= num_pages:
        raise _bad("tables", tables, f"{num_pages} pages do not fill transfers of widths {widths}")
    layout = params["layout"]
    if not isinstance(layout, list) or not all(
        isinstance(c, dict) and isinstance(c.get("page"), list) and isinstance(c.get("dtype"), str) for c in layout
    ):
        raise _bad("layout", layout, 'expected a list of {"page": [...], "dtype": ...}, one per cache')
    if params.get("lora_name") is not None and not isinstance(params["lora_name"], str):
        raise _bad("lora_name", params["lora_name"], "expected a string or null")
    return dict(params)


def parse_kv_transfer_params(params: Any) -> KVTransferRequest | None:
    """A request's kv_transfer_params checked (module docstring); None where they ask nothing."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise _bad("", params, "expected a JSON object")
    produce, consume = _flag(params, "do_remote_decode"), _flag(params, "do_remote_prefill")
    if produce and consume:
        raise _bad("do_remote_decode", True, "a request is either prefilled here for another server or decoded here")
    if produce:
        return KVTransferRequest("produce")
    if consume:
        return KVTransferRequest("consume", _check_ticket(params))
    return None
