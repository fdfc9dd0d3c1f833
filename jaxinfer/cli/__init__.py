"""The `jaxinfer` command: generate, chat, batch, info, convert and warm-up; `serve`/`client` come from serving/.

    args.py      engine and sampling flags shared by every subcommand, and the LLM they build
    generate.py  generate (prompts -> completions) and chat (interactive)
    batch.py     batch (a JSONL file of requests -> a JSONL file of results)
    info.py      info (model, devices, KV capacity as JSON)
    convert.py   convert (an HF directory or GGUF file -> an orbax checkpoint)
    warm_up.py   warm-up (every step variant compiled, or read, and kept for later starts)

Generated text goes to stdout alone; logs, progress and errors go to stderr. A user's mistake (a
bad path, a bad sampling value, an empty prompt) ends with one `error: ...` line and exit code 2.

Several hosts: start the same command on every host with --coordinator-address, --num-processes
and --process-id (or JAXINFER_* variables; "auto" on TPU pods). Process 0 reads the prompts and
writes the results; the others only run its steps and exit when it is done.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Sequence

from jaxinfer.cli import batch, convert, generate, info, warm_up
from jaxinfer.cli.args import USER_ERRORS, add_engine_args, add_sampling_args, make_llm, release_leaders
from jaxinfer.config.compile import MAX_COMPILE_THREADS, THREADS_VAR

__all__ = ["build_parser", "main", "run", "make_llm", "add_engine_args", "add_sampling_args"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxinfer",
        description="JAX/XLA LLM inference engine",
        epilog=f"environment: {THREADS_VAR}=N sets the threads an engine's warm-up compiles "
        f"its step variants on (default: one per core, at most {MAX_COMPILE_THREADS}; "
        "one on GPUs)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    generate.register(sub)
    info.register(sub)
    batch.register(sub)
    convert.register(sub)
    warm_up.register(sub)
    _add_plugins(sub)
    return parser


def _add_plugins(sub: argparse._SubParsersAction) -> None:
    """Subcommands other packages register (e.g. serving's `serve` and `client`) under the
    entry-point group "jaxinfer.cli"; found at run time, so jaxinfer never imports them."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="jaxinfer.cli"):
        ep.load()(sub, add_engine_args, add_sampling_args)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    verbosity = min(getattr(args, "verbose", 0), 2)
    logging.basicConfig(
        level=[logging.WARNING, logging.INFO, logging.DEBUG][verbosity],
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        release_leaders()


def run() -> None:
    """The `jaxinfer` program: `main`, then out without the interpreter's teardown once nothing is
    left to do. Collecting every object and freeing the JAX client's buffers and executables
    costs ~0.5 s after a warm `generate` on the 2-core CPU (a tenth of it) and changes no
    output; the exit handlers still run and the streams are flushed. A thread still working
    (not a daemon) gets the ordinary exit, which waits for it."""
    code = main()
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()  # logging's flush, weakref finalizers (temporary directories), jax's own
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe
            stream.flush()
    os._exit(code)
