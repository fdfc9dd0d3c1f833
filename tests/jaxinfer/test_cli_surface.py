"""The command line stays as users know it: every command lists the same flags, with the same
defaults, choices, help text and grouping as recorded in tests/fixtures/cli_surface.json (made by
tests/support/cli_surface.py before the flags were generated from the config fields)."""
from __future__ import annotations

import json

import pytest
from cli_surface import FIXTURE, surface

RECORDED = json.loads(FIXTURE.read_text())
NOW = surface()


def test_the_same_commands():
    assert sorted(NOW) == sorted(RECORDED)


@pytest.mark.parametrize("command", sorted(RECORDED))
def test_each_command_keeps_its_flags(command):
    now, recorded = NOW[command], RECORDED[command]
    assert sorted(now["flags"]) == sorted(recorded["flags"])
    for flag, want in recorded["flags"].items():
        assert json.loads(json.dumps(now["flags"][flag])) == want, f"{command} {flag}"
    assert sorted(map(sorted, now["exclusive"])) == sorted(map(sorted, recorded["exclusive"]))
    assert (now["epilog"], now["description"]) == (recorded["epilog"], recorded["description"])
