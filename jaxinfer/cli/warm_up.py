"""`jaxinfer warm-up`: an engine's step variants compiled (or read) and kept before anyone waits on them.

Give it the engine flags the engine will run with (`jaxinfer serve` builds the same engine from
the same flags; `serve --warm-up-only` does this with all of serve's): every step variant is read
from the executable store (--executable-cache-dir) or compiled and kept there and in JAX's
persistent cache (--compilation-cache-dir), so a later start with those flags loads each without
tracing, lowering or compiling. In a container image, or on a TPU VM before the service starts
(deploy/tpu_vm.sh). Prints each variant, where it came from (store: read from the executable
store; compiled: compiled, or read from JAX's cache), its seconds, and the totals;
--output-format json prints the same as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING

from jaxinfer.cli.args import add_engine_args, make_llm

if TYPE_CHECKING:
    from jaxinfer.llm import LLM


def cmd_warm_up(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    return print_warm_up(make_llm(args), start, args.output_format)  # serve's engine: every variant first


def print_warm_up(llm: LLM, start: float, output_format: str) -> int:
    """Prints each step variant of `llm`'s warm-up, where it came from and its seconds (a table,
    or one JSON object); `start`: when the command started. Returns the exit status, 0."""
    step = llm.engine.worker.step
    records, store = step.programs.records, step.programs.store
    summary = {
        "variants": [{"variant": r.variant, "source": r.source, "seconds": round(r.seconds, 3)} for r in records],
        "compiled": sum(r.source == "compiled" for r in records),
        "read_from_store": sum(r.source == "store" for r in records),
        "store": None if store is None else str(store.directory),
        "seconds": round(time.perf_counter() - start, 2),
    }
    if output_format == "json":
        print(json.dumps(summary))
        return 0
    width = max((len(r.variant) for r in records), default=7)
    print(f"{'variant':<{width}}  {'source':<8}  seconds")
    for r in records:
        print(f"{r.variant:<{width}}  {r.source:<8}  {r.seconds:7.2f}")
    where = "no executable store" if store is None else f"executable store {store.directory}"
    print(
        f"{len(records)} step variants ({summary['compiled']} compiled, {summary['read_from_store']} read), "
        f"{where}; {summary['seconds']:.1f} s from start"
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "warm-up",
        help="compile an engine's step variants and keep them, so later starts with the same flags load them",
        description=__doc__.split("\n\n", 1)[1].strip() if __doc__ else None,
    )
    add_engine_args(p)
    p.add_argument("--output-format", choices=("text", "json"), default="text", help="a table, or one JSON object")
    p.set_defaults(func=cmd_warm_up)
