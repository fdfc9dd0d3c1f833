"""`jaxinfer batch --ray`: the JSONL job of `jaxinfer batch` through Ray Data, exactly once across kills.

The input is one JSONL file, a directory of JSONL shards (`*.jsonl`, `*.jsonl.gz` left out, in name
order) or either behind a URI pyarrow reads (gs://, s3://, hdfs://); line numbers run on across the
shards as if they were one file. The output file, its journal (OUTPUT.journal) and the progress live
on the driver, as in `jaxinfer batch`:

1. The driver reads the input once (streaming) and, for each line, asks the journal whether a
   result for that line's text is already there; what is not goes into chunks: (shard, byte range,
   the runs of line numbers to serve), a few hundred lines each, which is all Ray holds of the input.
2. Ray Data reads each chunk's lines where it runs (`flat_map`) and hands them in batches to the
   replicas (integrations/ray.py's actors, one LLM each), which parse each line as `jaxinfer batch`
   does (rows.parse_line) and give back its record.
3. The driver appends each record to the journal (flushed and fsync'ed) as it arrives, at most once
   per line (a batch Ray runs twice after an actor died is not written twice), then writes the
   output in input order from the journal and moves it over OUTPUT.

Killed anywhere (the driver, an actor, the cluster) and run again with the same output, it serves
only the lines the journal lacks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import IO, Any, TypedDict

from tqdm import tqdm

from jaxinfer.integrations.ray import JaxinferProcessorConfig, Replica
from jaxinfer.journal import Journal, line_key
from jaxinfer.rows import line_error, parse_line, record_of

CHUNK_LINES = 256  # most lines per read task: few enough to spread over the replicas, enough to stay cheap


@dataclasses.dataclass
class Shard:
    uri: str  # as pyarrow opens it (a local path, or gs://bucket/path)
    first_line: int  # the global number of its first line


class Chunk(TypedDict):
    """Lines of one shard for one read task: its bytes [offset, offset + length), numbered from
    first_line, of which the runs [start, stop) are served."""

    uri: str
    offset: int
    length: int
    first_line: int
    runs: list[list[int]]


@dataclasses.dataclass
class Plan:
    chunks: list[Chunk]
    lines: list[list[int]]  # the runs of every non-blank line number, in order (the output's lines)
    todo: int = 0
    resumed: int = 0


def shards(uri: str) -> list[Shard]:
    """The input's files in order (ValueError naming the input when there are none)."""
    import pyarrow.fs as pafs

    fs, path = _filesystem(uri)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise ValueError(f"--input {uri}: does not exist")
    if info.type == pafs.FileType.File:
        return [Shard(uri, 1)]
    found = sorted(
        f.path for f in fs.get_file_info(pafs.FileSelector(path)) if f.is_file and f.base_name.endswith(".jsonl")
    )
    if not found:
        raise ValueError(f"--input {uri}: a directory with no *.jsonl files")
    prefix = uri[: len(uri) - len(path)] if "://" in uri else ""
    return [Shard(prefix + p, 0) for p in found]


def _filesystem(uri: str) -> tuple[Any, str]:
    import pyarrow.fs as pafs

    if "://" in uri:
        return pafs.FileSystem.from_uri(uri)
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))


def _lines(uri: str, offset: int = 0, length: int | None = None) -> Iterator[bytes]:
    fs, path = _filesystem(uri)
    with fs.open_input_file(path) as f:
        f.seek(offset)
        data = f.read(length) if length is not None else None
        if data is not None:
            yield from data.splitlines(keepends=True)
            return
        yield from _stream(f)


def _stream(f: IO[bytes]) -> Iterator[bytes]:
    rest = b""
    while block := f.read(1 << 20):
        *whole, rest = (rest + block).split(b"\n")
        for line in whole:
            yield line + b"\n"
    if rest:
        yield rest


def plan(uri: str, journal: Journal, replicas: int = 1) -> Plan:
    """Streaming passes over the input: its lines counted (so that every replica gets several chunks
    of a small job), then the chunks still to serve and what the journal already has."""
    files = shards(uri)
    total = sum(_count(shard.uri) for shard in files)
    size = max(1, min(CHUNK_LINES, total // (4 * replicas)))
    out = Plan([], [])
    lineno = 0
    for shard in files:
        offset = 0
        chunk: Chunk | None = None
        for raw in _lines(shard.uri):
            lineno += 1
            if chunk is None or lineno - chunk["first_line"] >= size:
                chunk = Chunk(uri=shard.uri, offset=offset, length=0, first_line=lineno, runs=[])
                out.chunks.append(chunk)
            offset += len(raw)
            chunk["length"] += len(raw)
            line = raw.decode("utf-8", errors="replace")
            if not line.strip():
                continue
            _extend(out.lines, lineno)
            if journal.done(lineno, line_key(line)):
                out.resumed += 1
            else:
                out.todo += 1
                _extend(chunk["runs"], lineno)
    out.chunks = [c for c in out.chunks if c["runs"]]
    return out


def _count(uri: str) -> int:
    fs, path = _filesystem(uri)
    count, last = 0, b"\n"
    with fs.open_input_stream(path) as f:
        while block := f.read(1 << 20):
            count, last = count + block.count(b"\n"), block[-1:]
    return count + (last != b"\n")


def _extend(runs: list[list[int]], n: int) -> None:
    if runs and runs[-1][1] == n:
        runs[-1][1] = n + 1
    else:
        runs.append([n, n + 1])


def read_chunk(chunk: dict[str, Any]) -> list[dict[str, Any]]:
    """A Chunk's lines to serve, as rows {"line", "text"} (run where Ray places the read task)."""
    wanted = {n for start, stop in chunk["runs"] for n in range(start, stop)}
    rows = []
    for i, raw in enumerate(_lines(chunk["uri"], chunk["offset"], chunk["length"])):
        if chunk["first_line"] + i in wanted:
            rows.append({"line": chunk["first_line"] + i, "text": raw.decode("utf-8", errors="replace")})
    return rows


class LineReplica(Replica):
    """A replica that serves `jaxinfer batch` lines: {"line", "text"} -> {"line", "sha", "record" (JSON)}."""

    async def __call__(self, batch):
        import asyncio

        import pyarrow

        rows = batch.to_pylist()
        records = await asyncio.gather(*(self._line(row["line"], row["text"]) for row in rows))
        return pyarrow.Table.from_pylist(
            [
                {"line": row["line"], "sha": line_key(row["text"]), "record": json.dumps(rec, ensure_ascii=False)}
                for row, rec in zip(rows, records)
            ]
        )

    async def _line(self, lineno: int, text: str) -> dict:
        try:
            rid, prompt, params, lora = parse_line(text, lineno, self.defaults, self.llm)
            return record_of(rid, await self.generate(prompt, params, lora))
        except Exception as e:  # noqa: BLE001 - any failure of one line is that line's error
            return {"id": None, "line": lineno, "error": line_error(e, lineno)}


def run(config: JaxinferProcessorConfig, input_uri: str, output: str, address: str | None) -> tuple[int, int, int]:
    """Runs the job; -> (served, failed, resumed) over every line of the input."""
    journal = Journal(f"{output}.journal")
    work = plan(input_uri, journal, config.replica_range()[1])
    if work.resumed:
        print(f"resuming: {work.resumed} results in {journal.path}", file=sys.stderr)
    start = time.monotonic()
    fresh, tokens = _serve(config, work, journal, address) if work.chunks else (0, 0)
    if fresh != work.todo:  # never expected: Ray hands back every row of a finished dataset
        raise RuntimeError(f"{fresh} of {work.todo} lines came back from the Ray job; run the command again")
    served, failed = _write(work, journal, output)
    elapsed = max(time.monotonic() - start, 1e-9)
    print(
        f"{served} served, {failed} failed ({work.resumed} from an earlier run, {fresh} run now) in "
        f"{elapsed:.1f}s: {fresh / elapsed:.2f} requests/s, {tokens / elapsed:.1f} output tokens/s over Ray",
        file=sys.stderr,
    )
    return served, failed, work.resumed


def _serve(config: JaxinferProcessorConfig, work: Plan, journal: Journal, address: str | None) -> tuple[int, int]:
    """The chunks through the replicas, each record journaled once as it arrives -> (records, tokens)."""
    import ray
    import ray.data

    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)
    config.check_cluster()
    ray.data.DataContext.get_current().enable_progress_bars = False  # the driver's own progress instead
    chunks = ray.data.from_items(list(work.chunks), override_num_blocks=len(work.chunks))
    dataset = chunks.flat_map(read_chunk, num_cpus=0)  # reads take no core the replicas hold
    dataset = dataset.map_batches(
        LineReplica,
        fn_constructor_kwargs={
            "model_source": config.model_source,
            "engine_kwargs": config.engine_kwargs,
            "defaults": config.defaults(),
        },
        **config.map_kwargs(),
    )
    start, fresh, tokens, shown = time.monotonic(), 0, 0, 0.0
    terminal = sys.stderr.isatty()
    with tqdm(total=work.todo, desc="batch", unit="req", disable=not terminal) as bar:
        for row in dataset.iter_rows():
            if journal.done(row["line"], row["sha"]):
                continue  # written already: a batch Ray ran again after its actor died
            record = json.loads(row["record"])
            journal.append(row["line"], row["sha"], record)
            fresh += 1
            tokens += sum(len(o["token_ids"]) for o in record.get("outputs", ()))
            rate = f"{tokens / max(time.monotonic() - start, 1e-9):.1f} output tokens/s"
            bar.update(1)
            bar.set_postfix_str(rate, refresh=False)
            if not terminal and time.monotonic() - shown >= 10:  # a line every 10 s in logs
                shown = time.monotonic()
                print(f"batch: {fresh}/{work.todo} lines, {rate}", file=sys.stderr, flush=True)
    return fresh, tokens


def _write(work: Plan, journal: Journal, output: str) -> tuple[int, int]:
    """The output in input order from the journal, moved over `output` whole -> (served, failed)."""
    served = failed = 0
    partial = f"{output}.partial"
    with open(partial, "w", encoding="utf-8") as dst:
        for first, stop in work.lines:
            for n in range(first, stop):
                if n not in journal:
                    raise RuntimeError(f"line {n}: no result came back from the Ray job; run the command again")
                record = journal.record(n)
                failed += "error" in record
                served += "error" not in record
                dst.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(partial, output)
    journal.close(remove=True)
    return served, failed
