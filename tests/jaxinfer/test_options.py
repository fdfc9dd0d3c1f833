"""One source for every option: each EngineConfig option (declared once as a field of its config
group) is reachable from `LLM(**options)`, from every command that builds an engine and from
`serve`, with the field's default; each SamplingParams field is a sampling flag (or says why it
is not). No engine is built: the CLI's values are read back into EngineConfig, and LLM is checked
up to the EngineConfig it hands the engine."""

from __future__ import annotations

import argparse
import inspect

import pytest

from jaxinfer import llm as llm_module
from jaxinfer.cli import build_parser
from jaxinfer.cli.args import engine_options, sampling_kwargs, sampling_options
from jaxinfer.cli.options import read_option, read_options
from jaxinfer.config import EngineConfig, SpeculativeConfig
from jaxinfer.config.compile import ATTN_IMPLS
from jaxinfer.config.engine import GROUPS, OPTION_GROUPS
from jaxinfer.config.lora import LoraModule
from jaxinfer.options import (
    APPEND,
    CSV,
    DISABLE,
    ENABLE,
    JSON,
    LIST,
    NONE,
    TRISTATE,
    VALUE,
    Declared,
    Option,
    declared,
    option,
)
from jaxinfer.sampling.params import SamplingParams, StructuredOutput

ENGINE_COMMANDS = (
    ["generate", "hi"],
    ["chat"],
    ["batch", "--input", "in.jsonl", "--output", "out.jsonl"],
    ["info"],
    ["serve"],
    ["warm-up"],
)
# Values for the text options whose field accepts only some strings.
TEXT = {
    "kv_cache_dtype": "int8",
    "reasoning_parser": "qwen3",
    "mesh": "tensor=1",
    "model": "/models/x",
    "chat_template": "{{ messages }}",
    "compilation_cache_dir": "/tmp/xla",
    "executable_cache_dir": "/tmp/executables",
    "coordinator_address": "10.0.0.1:1234",
    "kv_transfer_host": "10.0.0.2",
}
JSON_TEXT = {"speculative_config": ('{"method": "ngram", "num_speculative_tokens": 3}', SpeculativeConfig("ngram", 3))}


def sample(d: Declared) -> tuple[list[str], object]:
    """(argv that sets option `d` away from its default, the value the field then holds)."""
    form, flag = d.option.form, d.flag
    if form == ENABLE:
        return [flag], True
    if form == DISABLE:
        return [flag], False
    if form == TRISTATE:
        return [flag, "off"], False
    if form == JSON:
        text, value = JSON_TEXT[d.name]
        return [flag, text], value
    if form == CSV:
        return [flag, "1,512"], (1, 512)
    if form == LIST and d.name == "lora_target_modules":  # --lora-target-modules lm_head q_proj
        return [flag, "lm_head", "q_proj"], ("q_proj", "lm_head")
    if form == LIST:  # --lora-modules A=/x B=/y
        return [flag, "a=/x", '{"name": "b", "path": "/y"}'], (LoraModule("a", "/x"), LoraModule("b", "/y"))
    if d.option.choices:
        choice = next(c for c in reversed(d.option.choices) if c != d.default)
        return [flag, choice], choice
    if d.value_type is int:
        value = 24 if d.default is None else (d.default * 2 or d.default + 1)
        return [flag, str(value)], value
    if d.value_type is float:
        return [flag, str(d.default / 2)], d.default / 2
    return [flag, TEXT[d.name]], "data=1,stage=1,sequence=1,expert=1,tensor=1" if d.name == "mesh" else TEXT[d.name]


def config_of(argv: list[str]) -> EngineConfig:
    args = build_parser().parse_args(argv)
    return EngineConfig(**read_options(args, engine_options()))


def value_in(config: EngineConfig, name: str) -> object:
    group = OPTION_GROUPS[name]
    return getattr(getattr(config, group) if group else config, name)


OPTIONS = {d.name: d for d in engine_options()}


def test_option_names_are_unique_across_groups():
    names = [d.name for cls in GROUPS.values() for d in declared(cls)]
    assert len(names) == len(set(names)) and set(names) | {"speculative_config"} == set(OPTIONS)


@pytest.mark.parametrize("command", ENGINE_COMMANDS, ids=lambda c: c[0])
def test_every_engine_command_has_every_option_with_its_default(command):
    """Every command's defaults are EngineConfig's, but serve's compiling in the background."""
    defaults = EngineConfig()
    want = EngineConfig(compile_in_background=True) if command[0] == "serve" else defaults
    assert config_of(command) == want
    assert defaults.options() == {n: d.default for n, d in OPTIONS.items()}


@pytest.mark.parametrize("name", sorted(OPTIONS))
@pytest.mark.parametrize("command", ENGINE_COMMANDS, ids=lambda c: c[0])
def test_every_option_reaches_the_config_from_each_command(command, name):
    argv, want = sample(OPTIONS[name])
    assert value_in(config_of([*command, *argv]), name) == want


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_every_option_reaches_the_config_from_llm(monkeypatch, name):
    seen = {}

    def engine(model, config, warm_up):  # the engine LLM builds: record its config, build nothing
        seen["config"] = config
        raise SystemExit

    monkeypatch.setattr(llm_module, "Engine", engine)
    monkeypatch.setattr(llm_module, "_loaded", lambda model, config: None)
    monkeypatch.setattr(llm_module, "initialize", lambda *a: False)
    monkeypatch.setattr(llm_module, "load_chat_template", lambda text: text)
    argv, want = sample(OPTIONS[name])
    value = want if OPTIONS[name].option.form != JSON else JSON_TEXT[name][0]
    with pytest.raises(SystemExit):
        llm_module.LLM(**{name: value})
    assert value_in(seen["config"], name) == want


def test_llm_signature_lists_every_option_with_its_default():
    params = inspect.signature(llm_module.LLM).parameters
    for name, d in OPTIONS.items():
        assert params[name].default == d.default, name
    assert list(params)[:3] == ["model", "dtype", "warm_up"]


def test_unknown_options_are_refused_by_name():
    with pytest.raises(TypeError, match="unknown option 'max_num_seq'"):
        EngineConfig(max_num_seq=4)


def test_bad_values_are_named_by_their_group_checks():
    for options, match in [
        ({"page_size": 0}, "page_size must be a positive integer"),
        ({"num_pages": 1}, "num_pages must be at least 2"),
        ({"kv_cache_memory_fraction": 1.5}, r"kv_cache_memory_fraction must be in \(0, 1\]"),
        ({"greedy_variant": "yes"}, "greedy_variant must be a bool or None"),
        ({"token_buckets": (4, 2)}, "token_buckets must be increasing"),
        ({"token_buckets": (1, 8), "max_num_batched_tokens": 16}, "must reach max_num_batched"),
        ({"num_processes": -1}, "num_processes must be an integer >= 0"),
        ({"reasoning_parser": "r1"}, "reasoning_parser='r1'"),
        (
            {"enable_prompt_logprobs": True, "speculative_config": JSON_TEXT["speculative_config"][0]},
            "not supported together with speculative decoding",
        ),
    ]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(**options)


def test_replace_checks_again_and_keeps_the_rest():
    config = EngineConfig(max_num_seqs=8, page_size=32)
    assert config.replace(seed=5).scheduler.seed == 5 and config.replace(seed=5).cache.page_size == 32
    with pytest.raises(ValueError, match="max_num_seqs"):
        config.replace(max_num_seqs=0)


def test_attention_choices_match_the_kernels():
    from pallas_kernels.dispatch import IMPLS

    assert ATTN_IMPLS == IMPLS


def test_flags_that_do_not_parse_are_named():
    args = build_parser().parse_args(["generate", "x", "--token-buckets", "1,two", "--speculative-config", "{x"])
    with pytest.raises(ValueError, match="--token-buckets '1,two': expected comma-separated integers"):
        read_option(args, OPTIONS["token_buckets"])
    with pytest.raises(ValueError, match="--speculative-config '{x': not valid JSON"):
        read_option(args, OPTIONS["speculative_config"])


def test_an_option_without_a_flag_says_why():
    with pytest.raises(ValueError, match="says why"):
        Option("help", form=NONE)
    with pytest.raises(ValueError, match="form"):
        Option("help", form="sometimes")


# --- sampling ----------------------------------------------------------------------------------
SAMPLING = {d.name: d for d in sampling_options()}
SAMPLING_TEXT = {"logit_bias": ('{"7": -100}', {7: -100.0}), "stop": (["a", "b"], ("a", "b"))}


@pytest.mark.parametrize(
    "command",
    [["generate", "x"], ["batch", "--input", "i", "--output", "o"], ["client", "generate", "x"]],
    ids=lambda c: " ".join(c[:2]),
)
def test_every_sampling_field_is_a_flag_or_says_why(command):
    parser_args = build_parser().parse_args(command)
    params = SamplingParams(**sampling_kwargs(parser_args))
    for name, d in SAMPLING.items():
        if d.option.form == NONE:
            assert d.option.not_on_cli, name
            continue
        argv, want = _sampling_sample(d)
        args = build_parser().parse_args([*command, *argv])
        assert getattr(SamplingParams(**sampling_kwargs(args)), name) == want, name
    assert params.max_tokens == 128 and params.temperature == 0.0  # the CLI's own defaults


def _sampling_sample(d: Declared) -> tuple[list[str], object]:
    form, flag = d.option.form, d.flag
    if d.name in SAMPLING_TEXT:
        text, value = SAMPLING_TEXT[d.name]
        argv = [a for t in text for a in (flag, t)] if form == APPEND else [flag, text]
        return argv, value
    if form in (ENABLE, DISABLE):
        return [flag], form == ENABLE
    if form == CSV:
        return [flag, "3,5"], (3, 5)
    assert form == VALUE, d.name
    value = {int: 3, float: 0.5}[d.value_type]
    return [flag, str(value)], value


def test_structured_output_flags_are_its_fields_one_at_a_time():
    parser = build_parser()
    kinds = {d.name: d for d in declared(StructuredOutput)}
    for argv, kind in [
        (["--json-schema", '{"type": "object"}'], "json"),
        (["--json-object"], "json_object"),
        (["--regex", "a+"], "regex"),
        (["--choice", "x", "--choice", "y"], "choice"),
    ]:
        args = parser.parse_args(["generate", "p", *argv])
        assert SamplingParams(**sampling_kwargs(args)).structured_output.kind == kind
        assert kinds[kind].flag == argv[0]
    with pytest.raises(SystemExit):  # argparse: not allowed with each other
        parser.parse_args(["generate", "p", "--regex", "a", "--json-object"])


def test_option_helper_declares_a_field():
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Toy:
        width: int = option(3, "how wide")
        tags: tuple[str, ...] = option((), "a tag (repeatable)", form=APPEND)

    (width, tags) = declared(Toy)
    assert (width.flag, width.value_type, width.default) == ("--width", int, 3)
    parser = argparse.ArgumentParser()
    from jaxinfer.cli.options import add_options

    add_options(parser, declared(Toy))
    assert read_options(parser.parse_args(["--width", "5", "--tags", "a"]), declared(Toy)) == {
        "width": 5,
        "tags": ["a"],
    }
