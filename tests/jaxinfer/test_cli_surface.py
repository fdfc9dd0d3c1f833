"""The command line stays as users know it: every flag recorded in tests/fixtures/cli_surface.json
(made by tests/support/cli_surface.py before the flags were generated from the config fields)
is still there on the same command, with the same dest, default, type, choices, metavar and help
text. What may differ, deliberately: a flag that had no help text has one now; the engine's and
sampling's flags are listed under their config group's section; and commands gained the flags of
options they lacked (each of them generated from a declared option field)."""

from __future__ import annotations

import json

import pytest
from cli_surface import FIXTURE, surface

from jaxinfer.cli.args import engine_options, sampling_options
from jaxinfer.cli.options import dest
from jaxinfer.config import EngineConfig
from jaxinfer.options import NONE, declared
from jaxinfer.sampling.params import StructuredOutput

RECORDED = json.loads(FIXTURE.read_text())
NOW = surface()
SECTIONS = {d.flag: title for title, d in EngineConfig.declared()}
GENERATED = {
    d.flag for d in [*engine_options(), *sampling_options(), *declared(StructuredOutput)] if d.option.form != NONE
}


def test_the_same_commands():
    assert sorted(NOW) == sorted(RECORDED)


@pytest.mark.parametrize("command", sorted(RECORDED))
def test_each_command_keeps_its_flags(command):
    now, recorded = NOW[command]["flags"], RECORDED[command]["flags"]
    assert set(recorded) <= set(now), f"{command} lost {sorted(set(recorded) - set(now))}"
    assert set(now) - set(recorded) <= GENERATED, f"{command}: flags neither recorded nor generated"
    for flag, want in recorded.items():
        got = json.loads(json.dumps(now[flag]))
        if want["help"] is None and flag in GENERATED:
            assert got["help"], f"{command} {flag}: no help text"
            want = {**want, "help": got["help"]}
        assert {**got, "group": None} == {**want, "group": None}, f"{command} {flag}"
    exclusive = NOW[command]["exclusive"], RECORDED[command]["exclusive"]
    assert sorted(map(sorted, exclusive[0])) == sorted(map(sorted, exclusive[1]))
    assert (NOW[command]["epilog"], NOW[command]["description"]) == (
        RECORDED[command]["epilog"],
        RECORDED[command]["description"],
    )


@pytest.mark.parametrize("command", ["generate", "chat", "batch", "info", "serve"])
def test_engine_flags_are_listed_under_their_config_group(command):
    flags = NOW[command]["flags"]
    for flag, title in SECTIONS.items():
        assert flags[flag]["group"] == title, flag


def test_every_generated_flag_reads_back_under_its_dest():
    for d in [*engine_options(), *sampling_options()]:
        if d.option.form != NONE:
            assert dest(d) == NOW["generate"]["flags"][d.flag]["dest"]
