"""Option: a config dataclass's field together with its help text, choices and command-line form.

Every engine option (the groups of jaxinfer/config/) and every SamplingParams field is declared
once, as a dataclass field whose metadata holds an `Option`; the command line's flags
(jaxinfer/cli/options.py), `LLM(**options)` and `jaxinfer info` are generated from those fields,
so adding an option is adding one field. Plain Python, no JAX.

    page_size: int | None = option(None, "tokens per KV cache page")
    enable_prefix_caching: bool = option(True, "disable automatic prefix caching",
                                         form=DISABLE, flag="--no-prefix-caching")

Forms (how a field appears on the command line):
    VALUE     --flag VALUE, converted by `type` (the annotation's int or float; text otherwise)
    ENABLE    --flag sets a bool that defaults to False
    DISABLE   --flag clears a bool that defaults to True (named --no-...)
    TRISTATE  --flag {auto,on,off}: None (decided by the platform), True or False
    JSON      --flag JSON: the JSON text, decoded (its keys and values checked by the config)
    CSV       --flag 1,2,3: comma-separated integers
    APPEND    --flag X, repeatable: a list
    LIST      --flag X [Y ...], repeatable: a list (vLLM's form for lists such as --lora-modules)
    NONE      no flag; `not_on_cli` says why
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any

VALUE, ENABLE, DISABLE, TRISTATE, JSON, CSV, APPEND, LIST, NONE = (
    "value",
    "enable",
    "disable",
    "tristate",
    "json",
    "csv",
    "append",
    "list",
    "none",
)
FORMS = (VALUE, ENABLE, DISABLE, TRISTATE, JSON, CSV, APPEND, LIST, NONE)
TRISTATE_CHOICES = ("auto", "on", "off")


class _FieldDefault:
    """Option.cli_default when the command line takes the field's own default."""

    def __repr__(self) -> str:
        return "FIELD_DEFAULT"


FIELD_DEFAULT: Any = _FieldDefault()


@dataclasses.dataclass(frozen=True)
class Option:
    """How one field is offered to users. `flag` defaults to --the-field-name; `cli_default` is
    the command line's default where it differs from the field's (the CLI decodes greedily by
    default, say); `group` overrides the help section the flag is listed under."""

    help: str | None
    form: str = VALUE
    flag: str | None = None
    aliases: tuple[str, ...] = ()
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    type: Callable[[str], Any] | None = None
    cli_default: Any = FIELD_DEFAULT
    not_on_cli: str | None = None
    group: str | None = None

    def __post_init__(self):
        if self.form not in FORMS:
            raise ValueError(f"Option.form={self.form!r}: expected one of {FORMS}")
        if (self.form == NONE) != (self.not_on_cli is not None):
            raise ValueError("Option: a field without a flag (form NONE) says why in not_on_cli, and only it")


def option(
    default: Any = dataclasses.MISSING,
    help: str | None = None,
    *,  # noqa: A002 - argparse's name
    default_factory: Any = dataclasses.MISSING,
    **kwargs: Any,
) -> Any:
    """A dataclass field carrying an Option (see the module docstring)."""
    return dataclasses.field(
        default=default, default_factory=default_factory, metadata={"option": Option(help, **kwargs)}
    )


@dataclasses.dataclass(frozen=True)
class Declared:
    """One declared option: the field's name, default and annotation, and its Option."""

    name: str
    default: Any
    annotation: Any
    option: Option

    @property
    def flag(self) -> str:
        return self.option.flag or "--" + self.name.replace("_", "-")

    @property
    def value_type(self) -> Callable[[str], Any] | None:
        """The converter of a VALUE flag: the Option's, else int or float from the annotation."""
        if self.option.type is not None:
            return self.option.type
        kinds = _annotation_kinds(self.annotation)
        for kind in (int, float):
            if kind in kinds:
                return kind
        return None


def declared(cls: type) -> Iterator[Declared]:
    """The options a dataclass declares, in field order (fields without an Option are skipped)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        opt = f.metadata.get("option")
        if opt is None:
            continue
        default = (
            f.default
            if f.default is not dataclasses.MISSING
            else (f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        )
        yield Declared(f.name, default, hints.get(f.name), opt)


def _annotation_kinds(annotation: Any) -> set:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return set(typing.get_args(annotation))
    return {annotation}
