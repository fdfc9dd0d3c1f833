"""Command-line flags generated from declared options (jaxinfer/options.py), and read back.

`add_options(parser_or_group, declared)` adds one flag per option in its form; `read_option(args,
d)` turns what argparse parsed back into the field's value (a bad JSON or integer list is a
ValueError naming the flag). The engine's flags come from EngineConfig's groups, the sampling
flags from SamplingParams and StructuredOutput, so a new field is a new flag with no edit here.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from typing import Any

from jaxinfer.options import (
    APPEND,
    CSV,
    DISABLE,
    ENABLE,
    FIELD_DEFAULT,
    JSON,
    LIST,
    NONE,
    TRISTATE,
    TRISTATE_CHOICES,
    VALUE,
    Declared,
)


def dest(d: Declared) -> str:
    """The attribute argparse stores the flag under (its first long name, as argparse derives it)."""
    flags = [d.flag, *d.option.aliases]
    long = next((f for f in flags if f.startswith("--")), flags[0])
    return long.lstrip("-").replace("-", "_")


def cli_default(d: Declared) -> Any:
    return d.default if d.option.cli_default is FIELD_DEFAULT else d.option.cli_default


def add_option(group: Any, d: Declared) -> argparse.Action | None:
    """One flag for `d` on `group` (an ArgumentParser or an argument group); None for NONE."""
    opt = d.option
    flags = [d.flag, *opt.aliases]
    common: dict[str, Any] = {"help": opt.help}
    if opt.metavar is not None:
        common["metavar"] = opt.metavar
    if opt.form == VALUE:
        return group.add_argument(*flags, type=d.value_type, default=cli_default(d), choices=opt.choices, **common)
    if opt.form in (ENABLE, DISABLE):
        return group.add_argument(*flags, action="store_true", **common)
    if opt.form == TRISTATE:
        return group.add_argument(*flags, choices=list(TRISTATE_CHOICES), default="auto", **common)
    if opt.form in (JSON, CSV):
        return group.add_argument(*flags, default=None, **common)
    if opt.form == APPEND:
        return group.add_argument(*flags, action="append", default=None, **common)
    if opt.form == LIST:
        return group.add_argument(*flags, action="extend", nargs="+", default=None, **common)
    return None  # NONE: not on the command line


def add_options(group: Any, options: Iterable[Declared]) -> None:
    for d in options:
        add_option(group, d)


def read_option(args: argparse.Namespace, d: Declared) -> Any:
    """The field's value from the parsed flags (its CLI default where the flag was not given)."""
    form, value = d.option.form, getattr(args, dest(d), None)
    if form == ENABLE:
        return bool(value)
    if form == DISABLE:
        return not value
    if form == TRISTATE:
        return None if value is None else {"on": True, "off": False}.get(value)
    if form == JSON and value is not None:
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{d.flag} {value!r}: not valid JSON ({e.msg})") from None
    if form == CSV and value is not None:
        try:
            return [int(v) for v in value.split(",")]
        except ValueError:
            raise ValueError(f"{d.flag} {value!r}: expected comma-separated integers") from None
    if form in (APPEND, LIST):
        return value if value is not None else cli_default(d)
    return value


def read_options(args: argparse.Namespace, options: Iterable[Declared]) -> dict[str, Any]:
    """{field name: value} for every option that has a flag on this command."""
    return {d.name: read_option(args, d) for d in options if d.option.form != NONE and hasattr(args, dest(d))}
