"""MkDocs hooks (mkdocs.yml `hooks:`): reference pages generated from the code at build time, so
they cannot fall behind it.

    <!-- generated: cli -->               every command's --help, as argparse prints it
    <!-- generated: engine-options -->    EngineConfig's options by group: name, flag, default, help
    <!-- generated: sampling-options -->  SamplingParams' fields: name, flag, default, help
    <!-- generated: http-routes -->       the HTTP API's routes and request fields, from its OpenAPI schema
    <!-- generated: docstring PATH -->    the module docstring of PATH (a file of the repository)
    <!-- generated: benchmarks -->        every benchmarks/*.py script's docstring: what it measures, how
    <!-- generated: grpc -->              the gRPC service's calls and messages, from its descriptor, and the
                                          .proto file itself (its comments say what each field means)
"""

from __future__ import annotations

import argparse
import ast
import html
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


def _commands(parser: argparse.ArgumentParser, prefix: str) -> Iterable[tuple[str, argparse.ArgumentParser]]:
    yield prefix, parser
    for action in parser._actions:  # noqa: SLF001 -- argparse keeps its subcommands only there
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, f"{prefix} {name}")


def cli_reference() -> str:
    from jaxinfer.cli import build_parser

    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps help to the terminal's width: the same on every machine
    try:
        parts = [
            f"## `{name}`\n\n```text\n{parser.format_help().rstrip()}\n```\n"
            for name, parser in _commands(build_parser(), "jaxinfer")
        ]
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before
    return "\n".join(parts)


def _cell(value: Any) -> str:
    return html.escape(str(value), quote=False).replace("|", "\\|").replace("\n", " ")


def _table(rows: Iterable[Any]) -> str:
    lines = ["| option | flag | default | what |", "|---|---|---|---|"]
    for d in rows:
        flag = "(Python only)" if d.option.not_on_cli else f"`{d.flag}`"
        lines.append(f"| `{d.name}` | {flag} | `{_cell(d.default)}` | {_cell(d.option.help or d.option.not_on_cli)} |")
    return "\n".join(lines) + "\n"


def engine_options() -> str:
    from jaxinfer.config import EngineConfig

    by_group: dict[str, list[Any]] = {}
    for title, d in EngineConfig.declared():
        by_group.setdefault(title or "engine", []).append(d)
    return "\n".join(f"### {title}\n\n{_table(rows)}" for title, rows in by_group.items())


def sampling_options() -> str:
    from jaxinfer.options import declared
    from jaxinfer.sampling.params import SamplingParams

    return _table(declared(SamplingParams))


def _type(prop: dict) -> str:
    """A JSON schema property's type, briefly: `integer or null`, `array`, `ChatMessage`."""
    kinds = prop.get("anyOf") or prop.get("oneOf") or [prop]
    names = [k.get("type") or k.get("$ref", "").rsplit("/", 1)[-1] or "object" for k in kinds]
    return " or ".join(dict.fromkeys(str(n) for n in names))


def _default(prop: dict) -> str:
    return _cell(repr(prop["default"])) if "default" in prop else "required"


def http_routes() -> str:
    from serving.openai.schema import openapi_schema

    schema = openapi_schema("MODEL", lora_updates=True)  # the LoRA routes too (the page says when served)
    models = schema["components"]["schemas"]
    parts = []
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            parts.append(f"### `{method.upper()} {path}`\n\n{_cell(op.get('summary', ''))}\n")
            ref = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
            if "$ref" in ref:
                props = models[ref["$ref"].rsplit("/", 1)[-1]].get("properties", {})
                rows = [f"| `{name}` | {_cell(_type(prop))} | {_default(prop)} |" for name, prop in props.items()]
                parts.append("| field | type | default |\n|---|---|---|\n" + "\n".join(rows) + "\n")
    return "\n".join(parts)


def _scalar_names() -> dict[int, str]:
    from google.protobuf.descriptor import FieldDescriptor as F

    return {getattr(F, k): k.removeprefix("TYPE_").lower() for k in dir(F) if k.startswith("TYPE_")}


def grpc_reference() -> str:
    from serving.grpc.proto import jaxinfer_pb2

    file, scalars = jaxinfer_pb2.DESCRIPTOR, _scalar_names()
    parts = []
    for service in file.services_by_name.values():
        parts.append(f"## `{service.full_name}`\n\n| call | request | response |\n|---|---|---|")
        for m in service.methods:
            stream = "stream " if m.server_streaming else ""
            parts.append(f"| `{m.name}` | `{m.input_type.name}` | `{stream}{m.output_type.name}` |")
    parts.append("\n## Messages\n")
    for message in file.message_types_by_name.values():
        rows = []
        for f in message.fields:
            kind = f.message_type.name if f.message_type else f.enum_type.name if f.enum_type else scalars[f.type]
            repeated = "repeated " if f.is_repeated else ""
            rows.append(f"| `{f.name}` | `{repeated}{kind}` |")
        table = "| field | type |\n|---|---|\n" + "\n".join(rows) if rows else "(no fields)"
        parts.append(f"### `{message.name}`\n\n{table}\n")
    proto = Path(jaxinfer_pb2.__file__).with_name("jaxinfer.proto").read_text()
    parts.append(f"## `jaxinfer.proto`\n\n```protobuf\n{proto.rstrip()}\n```\n")
    return "\n".join(parts)


ROOT = Path(__file__).resolve().parents[1]
DOCSTRING = re.compile(r"<!-- generated: docstring (\S+) -->")


def docstring(path: str) -> str:
    """A module's docstring as a block of text under its file's name (read, not imported)."""
    text = ast.get_docstring(ast.parse((ROOT / path).read_text()))
    if not text:
        raise ValueError(f"{path} has no module docstring to show")
    return f"`{path}`\n\n```text\n{text}\n```\n"


def benchmarks() -> str:
    parts = []
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        text = ast.get_docstring(ast.parse(script.read_text()))
        if text:
            parts.append(f"## `{script.name}`\n\n```text\n{text}\n```\n")
    return "\n".join(parts)


GENERATED: dict[str, Callable[[], str]] = {
    "cli": cli_reference,
    "engine-options": engine_options,
    "sampling-options": sampling_options,
    "http-routes": http_routes,
    "grpc": grpc_reference,
    "benchmarks": benchmarks,
}


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    for key, make in GENERATED.items():
        marker = f"<!-- generated: {key} -->"
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return DOCSTRING.sub(lambda m: docstring(m.group(1)), markdown)
