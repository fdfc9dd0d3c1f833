"""`jaxinfer batch`: a JSONL file of requests in, a JSONL file of results out.

Each input line is one request:
    {"id": "a1", "prompt": "text"}                       or "prompt_token_ids": [...]
    {"id": "a2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "temperature": 0.7}
Any SamplingParams field may be set per line; unset fields take the command line's values. Each
output line has the request's id, its outputs (text, token ids, finish reason) and usage, in input
order. A broken line (bad JSON, no prompt, a bad sampling value, a prompt too long, messages the
chat template rejects) gets an output line with "error" naming the problem and the line number;
every other line is still served. Paths are checked before the model loads, and results are
written to OUTPUT.partial and moved over OUTPUT only when complete, so an earlier result file at
the same path is never emptied by a job that fails.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from jaxinfer.cli.args import add_engine_args, add_sampling_args, check_file, make_llm, sampling_params
from jaxinfer.sampling.params import SamplingParams

if TYPE_CHECKING:
    from jaxinfer.llm import LLM

_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def parse_line(line: str, lineno: int, defaults: SamplingParams,
               llm: LLM) -> tuple[str, str | list[int], SamplingParams]:
    """-> (id, prompt or token ids, params); ValueError naming the problem."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"line {lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"line {lineno}: expected a JSON object, got {type(obj).__name__}")
    rid = str(obj.get("id", lineno))
    unknown = set(obj) - _FIELDS - {"id", "prompt", "prompt_token_ids", "messages"}
    if unknown:
        raise ValueError(f"line {lineno}: unknown fields {sorted(unknown)}")
    sources = [k for k in ("prompt", "prompt_token_ids", "messages") if k in obj]
    if len(sources) != 1:
        raise ValueError(f"line {lineno}: give exactly one of prompt, prompt_token_ids, messages")
    if "messages" in obj:
        prompt = llm.render_chat(obj["messages"])
    elif "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise ValueError(f"line {lineno}: prompt must be a string")
        prompt = obj["prompt"]
    else:
        prompt = obj["prompt_token_ids"]
        if not isinstance(prompt, list):
            raise ValueError(f"line {lineno}: prompt_token_ids must be a list of integers")
    overrides = {k: (tuple(v) if isinstance(v, list) else v) for k, v in obj.items() if k in _FIELDS}
    try:
        params = dataclasses.replace(defaults, **overrides)
    except (ValueError, TypeError) as e:
        raise ValueError(f"line {lineno}: {e}") from None
    return rid, prompt, params


def run_batch(llm: LLM, lines: TextIO, out: TextIO, defaults: SamplingParams,
              use_tqdm: bool = False) -> tuple[int, int]:
    """Serves every line; returns (served, failed)."""
    records: list[dict | None] = []
    requests: list[tuple[int, str]] = []  # (record index, engine request id)
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rid, prompt, params = parse_line(line, lineno, defaults, llm)
            requests.append((len(records), llm.engine.add_request(prompt, params)))
            records.append({"id": rid})
        except Exception as e:  # noqa: BLE001 - any failure of one line is that line's error
            records.append({"id": None, "line": lineno, "error": _line_error(e, lineno)})
    results = llm.collect([r for _, r in requests], use_tqdm) if requests else {}
    for index, engine_id in requests:
        res = results[engine_id]
        records[index].update(
            outputs=[{"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                      "stop_reason": c.stop_reason} for c in res.outputs],
            usage=dataclasses.asdict(res.usage))
    for record in records:
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
    failed = sum(1 for r in records if "error" in r)
    return len(records) - failed, failed


def _line_error(e: Exception, lineno: int) -> str:
    message = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
    return message if message.startswith("line") else f"line {lineno}: {message}"


def check_paths(input_path: str, output_path: str) -> None:
    """ValueError naming a path that cannot work, before anything slow happens."""
    check_file("--input", input_path)
    if output_path != "-":
        out = Path(output_path)
        if out.is_dir():
            raise ValueError(f"--output {output_path}: is a directory")
        if not out.parent.is_dir():
            raise ValueError(f"--output {output_path}: directory {out.parent} does not exist")


def cmd_batch(args: argparse.Namespace) -> int:
    check_paths(args.input, args.output)
    defaults = sampling_params(args)
    llm = make_llm(args)
    src = sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")
    partial = None if args.output == "-" else f"{args.output}.partial"
    dst = sys.stdout if partial is None else open(partial, "w", encoding="utf-8")
    with src, dst:
        served, failed = run_batch(llm, src, dst, defaults, use_tqdm=sys.stderr.isatty())
    if partial is not None:
        os.replace(partial, args.output)  # the finished file appears whole, or not at all
    print(f"{served} served, {failed} failed", file=sys.stderr)
    return 0 if served or not failed else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("batch", help="run a JSONL file of requests, write a JSONL file of results")
    p.add_argument("--input", required=True, help="JSONL requests ('-' = stdin)")
    p.add_argument("--output", default="-", help="JSONL results (default: stdout)")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_batch)
