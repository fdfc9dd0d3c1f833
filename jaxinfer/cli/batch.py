"""`jaxinfer batch`: a JSONL file of requests in, a JSONL file of results out.

Each input line is one request:
    {"id": "a1", "prompt": "text"}                       or "prompt_token_ids": [...]
    {"id": "a2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "temperature": 0.7}
    {"id": "a3", "messages": [...], "tools": [...], "chat_template_kwargs": {"enable_thinking": false}}
    {"id": "a4", "prompt": "text", "lora": "sql"}         a LoRA adapter by name (--lora-modules), or
    {"id": "a5", "prompt": "text", "lora": {"name": "sql", "path": "/adapters/sql"}}   by path
Any SamplingParams field may be set per line; unset fields take the command line's values. Each
output line has the request's id, its outputs (text, token ids, finish reason, and logprobs when
asked for), usage, and "prompt_logprobs" when asked for (the engine needs
--enable-prompt-logprobs, or --prompt-logprobs on the command line), in input order. A broken
line (bad JSON, no prompt, a bad sampling value, a prompt too long, messages the chat template
rejects) gets an output line with "error" naming the problem and the line number; every other
line is still served. Paths are checked before the model loads.

The input is streamed (at most --max-in-flight requests are read ahead into the engine). With a
file output the job is exactly once across kills (jaxinfer/journal.py): every finished result is
journaled and fsync'ed in OUTPUT.journal, results go in input order to OUTPUT.partial, and the
partial file is moved over OUTPUT only when complete (an earlier result file at that path is never
emptied by a job that fails). Rerun the same command after a kill and only the lines the journal
lacks (or whose text changed) are served. A progress bar with ETA shows on a terminal; a summary of
requests/s and output tokens/s ends the run on stderr.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from tqdm import tqdm

from jaxinfer.cli.args import (
    add_engine_args,
    add_ray_args,
    add_sampling_args,
    check_file,
    llm_options,
    make_llm,
    sampling_params,
)
from jaxinfer.journal import Journal, line_key
from jaxinfer.rows import line_error, parse_line, record_of
from jaxinfer.sampling.params import SamplingParams

if TYPE_CHECKING:
    from jaxinfer.llm import LLM
    from jaxinfer.outputs import RequestOutput


@dataclasses.dataclass
class BatchStats:
    served: int = 0
    failed: int = 0
    resumed: int = 0  # of served + failed: taken from the journal of an earlier run
    output_tokens: int = 0


class _Job:
    """The lines in flight, their accumulated outputs, and the in-order writer."""

    def __init__(self, llm: LLM, out: TextIO, journal: Journal | None, bar: tqdm):
        self.llm, self.out, self.journal, self.bar = llm, out, journal, bar
        self.stats = BatchStats()
        self.order: collections.deque[int] = collections.deque()  # line numbers, input order
        self.ready: dict[int, dict] = {}  # finished records waiting for the lines before them
        self.in_flight: dict[str, tuple[int, str, str]] = {}  # engine id -> (line, sha, id)
        self.outputs: dict[str, RequestOutput] = {}

    def step(self) -> None:
        for delta in self.llm.engine.step():
            if delta.request_id not in self.in_flight:
                continue
            acc = self.outputs.setdefault(delta.request_id, delta)
            if acc is not delta:
                acc.merge(delta)
            if acc.finished:
                lineno, key, rid = self.in_flight.pop(delta.request_id)
                del self.outputs[delta.request_id]
                self.finish(lineno, key, record_of(rid, acc))

    def finish(self, lineno: int, key: str, record: dict, resumed: bool = False) -> None:
        if self.journal is not None and not resumed:
            self.journal.append(lineno, key, record)
        failed = "error" in record
        self.stats.failed += failed
        self.stats.served += not failed
        self.stats.resumed += resumed
        self.stats.output_tokens += sum(len(o["token_ids"]) for o in record.get("outputs", ()))
        self.ready[lineno] = record
        self.bar.update(1)
        while self.order and self.order[0] in self.ready:
            self.out.write(json.dumps(self.ready.pop(self.order.popleft()), ensure_ascii=False) + "\n")


def run_batch(
    llm: LLM,
    lines: Iterable[str],
    out: TextIO,
    defaults: SamplingParams,
    use_tqdm: bool = False,
    *,
    journal: Journal | None = None,
    max_in_flight: int | None = None,
    total: int | None = None,
) -> BatchStats:
    """Serves every line, reading the input as it goes (at most `max_in_flight` requests in the
    engine) and writing results to `out` in input order. With a journal, lines it holds for
    the same input text are not served again and each new result is journaled as it finishes."""
    max_in_flight = max_in_flight or 4 * llm.engine.config.scheduler.max_num_seqs
    with tqdm(total=total, desc="batch", unit="req", disable=not use_tqdm) as bar:
        job = _Job(llm, out, journal, bar)
        try:
            for lineno, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                job.order.append(lineno)
                key = line_key(line)
                if journal is not None and journal.done(lineno, key):
                    job.finish(lineno, key, journal.record(lineno), resumed=True)
                    continue
                try:
                    rid, prompt, params, lora = parse_line(line, lineno, defaults, llm)
                    job.in_flight[llm.engine.add_request(prompt, params, lora_request=lora)] = (lineno, key, rid)
                except Exception as e:  # noqa: BLE001 - any failure of one line is that line's error
                    job.finish(lineno, key, {"id": None, "line": lineno, "error": line_error(e, lineno)})
                while len(job.in_flight) >= max_in_flight:
                    job.step()
            while job.in_flight:
                job.step()
        finally:
            llm.engine.release_followers()
    return job.stats


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
    if args.ray is not None:
        return _cmd_batch_ray(args)
    check_paths(args.input, args.output)
    defaults = sampling_params(args)
    llm = make_llm(args, prompt_logprobs=defaults.prompt_logprobs is not None)
    total = None if args.input == "-" else _count_lines(args.input)
    journal = None if args.output == "-" else Journal(f"{args.output}.journal")
    if journal is not None and len(journal):
        print(f"resuming: {len(journal)} results in {journal.path}", file=sys.stderr)
    src = sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")
    partial = None if args.output == "-" else f"{args.output}.partial"
    dst = sys.stdout if partial is None else open(partial, "w", encoding="utf-8")
    start = time.monotonic()
    with src, dst:
        stats = run_batch(
            llm,
            src,
            dst,
            defaults,
            use_tqdm=sys.stderr.isatty(),
            journal=journal,
            max_in_flight=args.max_in_flight,
            total=total,
        )
    if partial is not None:
        os.replace(partial, args.output)  # the finished file appears whole, or not at all
        if journal is not None:  # there is one whenever the output is a file
            journal.close(remove=True)
    elapsed = max(time.monotonic() - start, 1e-9)
    fresh = stats.served + stats.failed - stats.resumed
    print(
        f"{stats.served} served, {stats.failed} failed ({stats.resumed} from an earlier run) in "
        f"{elapsed:.1f}s: {fresh / elapsed:.2f} requests/s, {stats.output_tokens / elapsed:.1f} "
        "output tokens/s",
        file=sys.stderr,
    )
    return 0 if stats.served or not stats.failed else 1


def _cmd_batch_ray(args: argparse.Namespace) -> int:
    """The same job through Ray Data (jaxinfer/integrations/ray_batch.py): --input a file, a
    directory of shards or a URI, --output a local file, exactly once across kills."""
    if args.output == "-":
        raise ValueError("--output: --ray writes a file (its journal makes the job resumable), not stdout")
    if args.input == "-":
        raise ValueError("--input -: --ray reads files (the replicas read their lines), not stdin")
    check_paths("-" if "://" in args.input or Path(args.input).is_dir() else args.input, args.output)
    try:
        import ray.data  # noqa: F401 - the extra is there, or the error says how to get it

        from jaxinfer.integrations import ray_batch
        from jaxinfer.integrations.ray import JaxinferProcessorConfig, resources_from_json
    except ImportError as e:
        raise ValueError(f"--ray needs Ray Data: pip install 'jaxinfer[ray]' ({e})") from None
    defaults = sampling_params(args)
    options = llm_options(args, prompt_logprobs=defaults.prompt_logprobs is not None)
    resources = resources_from_json("--ray-resources", args.ray_resources)
    config = JaxinferProcessorConfig(
        model_source=options.pop("model"),
        engine_kwargs=options,
        concurrency=args.replicas,
        batch_size=args.ray_batch_size,
        # each replica holds --max-in-flight lines (4 x --max-num-seqs by default), in batches
        max_concurrent_batches=-(-(args.max_in_flight or 4 * options["max_num_seqs"]) // args.ray_batch_size),
        num_cpus=float(resources.pop("CPU", 1)),
        num_gpus=float(resources.pop("GPU", 0)),
        resources=resources,
        sampling_defaults=defaults,
    )
    served, failed, _ = ray_batch.run(config, args.input, args.output, None if args.ray == "auto" else args.ray)
    return 0 if served or not failed else 1


def _count_lines(path: str) -> int:
    """Non-blank lines of the input, read in a streaming pass (for the progress bar's ETA)."""
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("batch", help="run a JSONL file of requests, write a JSONL file of results")
    p.add_argument("--input", required=True, help="JSONL requests ('-' = stdin)")
    p.add_argument(
        "--output",
        default="-",
        help="JSONL results (default: stdout); a file output "
        "is resumable: rerun the same command after a kill and only the rest is served",
    )
    p.add_argument(
        "--max-in-flight",
        type=int,
        default=None,
        help="requests read ahead into the engine (default: 4 x --max-num-seqs); with --ray, per replica",
    )
    ray = add_ray_args(
        p,
        "run the job through Ray Data (--input may then be a directory of *.jsonl shards or a gs:// or s3:// URI)",
        "engine replicas (Ray actors, one LLM each)",
    )
    ray.add_argument("--ray-batch-size", type=int, default=16, help="lines per batch handed to a replica")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_batch)
