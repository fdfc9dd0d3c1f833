"""Measured block sizes for the GPU kernel: a table of `bench_attention.py --sweep` results.

Each entry of gpu_tuned.json is a shape the sweep timed on a device kind (head_dim, GQA group,
page size, dtype, decode or prefill, the batch's sequence count and longest context) and the
config that ran fastest there, with its time and the heuristic default's. `lookup` returns the
config of the nearest entry (same device kind, head_dim, group, page size, dtype and mode; the
closest sequence count and context, by ratio, within 2x of the count and 4x of the context) or
None; default_config then
checks that it fits the shared-memory budget before using it. `bench_attention --sweep
--write-table` adds or replaces entries.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

TABLE = Path(__file__).with_name("gpu_tuned.json")
FIELDS = ("block_q", "block_kv", "num_splits", "num_warps", "num_stages")
# How far an entry reaches. The knobs a decode sweep settles (KV splits, warps) follow the number
# of programs, sequences x KV heads, against the SM count, so an entry stays near its sequence
# count: on an H200 (2026-11-26) the 64-sequence entry (2 splits, 8 warps) ran 256 sequences at
# 0.85 ms where the heuristic's (1 split, 4 warps) took 0.49.
_MAX_SEQS_RATIO = 2.0
_MAX_KV_RATIO = 4.0


@functools.lru_cache(maxsize=4)
def load(path: str = str(TABLE)) -> tuple[dict, ...]:
    """The table's entries (validated), or none if the file is absent."""
    p = Path(path)
    if not p.is_file():
        return ()
    entries = json.loads(p.read_text())["entries"]
    for e in entries:
        missing = [
            k
            for k in ("device", "head_dim", "group", "page_size", "dtype", "mode", "num_seqs", "max_kv", "config")
            if k not in e
        ]
        if missing or set(e["config"]) != set(FIELDS) or e["mode"] not in ("decode", "prefill"):
            raise ValueError(f"{p}: malformed entry {e} (missing {missing})")
    return tuple(entries)


def lookup(
    device_kind: str,
    head_dim: int,
    group: int,
    page_size: int,
    dtype: str,
    mode: str,
    num_seqs: int,
    max_kv: int,
    path: str | None = None,
) -> dict | None:
    """The config fields of the nearest measured shape, or None."""
    best, best_score = None, math.inf
    for e in load(str(path or TABLE)):
        if (e["device"], e["head_dim"], e["group"], e["page_size"], e["dtype"], e["mode"]) != (
            device_kind,
            head_dim,
            group,
            page_size,
            dtype,
            mode,
        ):
            continue
        seqs_ratio = max(num_seqs, e["num_seqs"]) / max(1, min(num_seqs, e["num_seqs"]))
        kv_ratio = max(max_kv, e["max_kv"]) / max(1, min(max_kv, e["max_kv"]))
        if seqs_ratio > _MAX_SEQS_RATIO or kv_ratio > _MAX_KV_RATIO:
            continue
        score = math.log(seqs_ratio) + math.log(kv_ratio)
        if score < best_score:
            best, best_score = e["config"], score
    return dict(best) if best is not None else None


def merge(entries: list[dict], path: str | None = None) -> None:
    """Adds entries to the table file, replacing those measured for the same shape."""

    def key(e):
        return tuple(e[k] for k in ("device", "head_dim", "group", "page_size", "dtype", "mode", "num_seqs", "max_kv"))

    p = Path(path or TABLE)
    old = json.loads(p.read_text())["entries"] if p.is_file() else []
    by_key = {key(e): e for e in old}
    by_key.update({key(e): e for e in entries})
    p.write_text(json.dumps({"entries": sorted(by_key.values(), key=key)}, indent=1) + "\n")
    load.cache_clear()
