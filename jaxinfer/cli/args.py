"""What every subcommand shares: engine and sampling flags, and the LLM they build.

The flags are generated (cli/options.py) from EngineConfig's option fields and SamplingParams'
fields, so every option has one flag, default and help text. `serve` and `client` (serving/) get
`add_engine_args` / `add_sampling_args` through the plugin hook, so every way in takes the same
flags.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxinfer.cli.options import add_option, add_options, read_option, read_options
from jaxinfer.config import ConfigError, EngineConfig
from jaxinfer.options import Declared, declared
from jaxinfer.sampling.params import SamplingParams, StructuredOutput, logit_bias_from_json
from jaxinfer.sampling.structured_output import STRUCTURED_TITLE

if TYPE_CHECKING:
    from jaxinfer.llm import LLM  # imports JAX: only when a command runs

# A user's mistake: one `error:` line and exit 2. OSErrors of paths the user named carry the path.
USER_ERRORS = (
    ValueError,
    ConfigError,
    FileNotFoundError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
)


def check_file(flag: str, path: str | None) -> None:
    """ValueError naming `flag` and `path` unless it is a readable file (None: not given)."""
    if path is None or path == "-":
        return
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"{flag} {path}: does not exist")
    if not p.is_file():
        raise ValueError(f"{flag} {path}: is {'a directory' if p.is_dir() else 'not a regular file'}")
    if not os.access(p, os.R_OK):
        raise ValueError(f"{flag} {path}: is not readable")


def engine_options() -> list[Declared]:
    return [d for _, d in EngineConfig.declared()]


def sampling_options() -> list[Declared]:
    return list(declared(SamplingParams))


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig option, in a help section per config group."""
    sections: dict[str, argparse._ArgumentGroup] = {}
    for title, d in EngineConfig.declared():
        if title not in sections:
            sections[title] = p.add_argument_group(title)
        add_option(sections[title], d)
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging on stderr")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """One flag per SamplingParams field; StructuredOutput's fields as one exclusive group."""
    add_options(p.add_argument_group("sampling"), sampling_options())
    structured = p.add_argument_group(STRUCTURED_TITLE).add_mutually_exclusive_group()
    add_options(structured, declared(StructuredOutput))


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(**sampling_kwargs(args))


def sampling_kwargs(args: argparse.Namespace) -> dict:
    """SamplingParams' fields from the sampling flags (values checked by SamplingParams)."""
    kwargs = read_options(args, sampling_options())
    kwargs["logit_bias"] = logit_bias(args)
    kwargs["structured_output"] = structured_output(args)
    return kwargs


def logit_bias(args: argparse.Namespace) -> dict[int, object] | None:
    """--logit-bias JSON as {token id: bias} (its values are checked by SamplingParams)."""
    field = next(d for d in sampling_options() if d.name == "logit_bias")
    return logit_bias_from_json(read_option(args, field), "--logit-bias")


def structured_output(args: argparse.Namespace) -> StructuredOutput | None:
    if args.json_schema is not None:
        schema = args.json_schema
        if not schema.lstrip().startswith("{"):
            check_file("--json-schema", schema)
            schema = Path(schema).read_text(encoding="utf-8")
        return StructuredOutput(json=schema)
    if args.grammar is not None:
        check_file("--grammar", args.grammar)
        return StructuredOutput(grammar=Path(args.grammar).read_text(encoding="utf-8"))
    if args.json_object or args.regex is not None or args.choice:
        return StructuredOutput(json_object=args.json_object, regex=args.regex, choice=args.choice)
    return None


_LEADERS: list[LLM] = []  # LLMs of process 0 whose followers must be shut down at exit


def check_reasoning_parser(args: argparse.Namespace) -> None:
    """--reasoning-parser names a known format (ValueError naming it, before the model loads)."""
    from jaxinfer.tokenizer.reasoning import reasoning_parser

    value = getattr(args, "reasoning_parser", None)
    if value is None:
        return
    try:
        reasoning_parser(value)
    except ValueError as e:  # "reasoning_parser='x': unknown; choose one of ..."
        raise ValueError(f"--reasoning-parser {value}: {str(e).split(': ', 1)[1]}") from None


def llm_options(args: argparse.Namespace, penalties: bool = True, prompt_logprobs: bool = False) -> dict[str, Any]:
    """LLM's options as the command line gives them (see make_llm for `penalties`, `prompt_logprobs`)."""
    check_reasoning_parser(args)
    options = read_options(args, engine_options())
    options["penalties"] = options["penalties"] and penalties
    options["enable_prompt_logprobs"] = options["enable_prompt_logprobs"] or prompt_logprobs
    return options


def make_llm(
    args: argparse.Namespace, penalties: bool = True, warm_up: bool = True, prompt_logprobs: bool = False
) -> LLM:
    """The LLM of the command line (`penalties` False: the command needs no penalty variants;
    `prompt_logprobs`: their steps compiled even without --enable-prompt-logprobs). On processes
    other than 0 of a multi-host run it serves process 0's steps until told to stop, then exits:
    the command itself runs on process 0."""
    from jaxinfer.llm import LLM

    llm = LLM(warm_up=warm_up, **llm_options(args, penalties, prompt_logprobs))
    if not llm.engine.is_leader:
        while llm.engine.follow():
            pass
        raise SystemExit(0)
    _LEADERS.append(llm)
    return llm


def release_leaders() -> None:
    """Shuts down the follower processes of every LLM this command built (multi-host runs)."""
    while _LEADERS:
        _LEADERS.pop().engine.release_followers(shutdown=True)


def add_ray_args(p: argparse.ArgumentParser, ray_help: str, replicas_help: str) -> argparse._ArgumentGroup:
    """--ray [ADDRESS], --replicas and --ray-resources (batch and serve on a Ray cluster); the group,
    for a command's own Ray flags."""
    g = p.add_argument_group("Ray (pip install 'jaxinfer[ray]')")
    g.add_argument(
        "--ray",
        nargs="?",
        const="auto",
        default=None,
        metavar="ADDRESS",
        help=f"{ray_help} on a Ray cluster: ADDRESS (host:6379 or ray://host:10001), or without one the "
        "cluster RAY_ADDRESS names or a local one",
    )
    g.add_argument("--replicas", type=int, default=1, help=replicas_help)
    g.add_argument(
        "--ray-resources",
        default='{"CPU": 1}',
        metavar="JSON",
        help='what one replica holds, as Ray counts it: e.g. \'{"TPU": 4}\' or \'{"CPU": 4, "GPU": 1}\'',
    )
    return g
