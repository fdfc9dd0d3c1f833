"""Every flag of the `jaxinfer` command line as plain data (for the help-stability test).

`surface()` walks the parser tree -- each subcommand, nested ones included (`client generate`) --
and records, per option: its strings, dest, default, type, choices, nargs, metavar, help text, and
the title of the argument group it is listed under. Comparing it against the fixture shows any flag
that changed name, default, help or grouping.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "cli_surface.json"


def _action(action: argparse.Action, group: str) -> dict:
    kind = type(action).__name__
    default = action.default
    if not isinstance(default, (str, int, float, bool, type(None), list, tuple)):
        default = repr(default)
    return {
        "dest": action.dest,
        "kind": kind,
        "default": default,
        "type": getattr(action.type, "__name__", None) if action.type else None,
        "choices": list(action.choices) if action.choices is not None and kind != "_SubParsersAction" else None,
        "nargs": action.nargs,
        "metavar": action.metavar,
        "help": action.help,
        "group": group,
        "required": action.required,
    }


def _parser(p: argparse.ArgumentParser, prefix: str, out: dict) -> None:
    groups = {id(a): g.title for g in p._action_groups for a in g._group_actions}
    flags = {}
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                _parser(sub, f"{prefix} {name}".strip(), out)
            continue
        key = "/".join(action.option_strings) or action.dest
        flags[key] = _action(action, groups.get(id(action), ""))
    exclusive = [sorted("/".join(a.option_strings) for a in g._group_actions) for g in p._mutually_exclusive_groups]
    out[prefix or "jaxinfer"] = {
        "flags": flags,
        "exclusive": exclusive,
        "epilog": p.epilog,
        "description": p.description,
    }


def surface() -> dict:
    from jaxinfer.cli import build_parser

    out: dict = {}
    _parser(build_parser(), "", out)
    return out


if __name__ == "__main__":  # python tests/support/cli_surface.py > tests/fixtures/cli_surface.json
    print(json.dumps(surface(), indent=1, sort_keys=True))
