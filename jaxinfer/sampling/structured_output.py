"""StructuredOutput: what a request's output must be -- JSON a schema accepts, any JSON object,
a regular expression's match, one of some strings, or a Lark grammar's sentence (no JAX).

jaxinfer/structured/ compiles it into a grammar matcher whose allowed-token bits constrain each
sampled token; on the command line its fields are one group of mutually exclusive flags.
"""

from __future__ import annotations

import dataclasses
import json

from jaxinfer.options import APPEND, ENABLE, option

STRUCTURED_TITLE = "structured output (one of)"


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """Constrains a request's output; exactly one field is set (vLLM's guided decoding):
    `json` a JSON schema (dict or JSON text; the output is one JSON value it accepts),
    `json_object` any JSON object, `regex` a regular expression the whole output matches,
    `choice` one of these strings, `grammar` a Lark grammar (llguidance's dialect). On the command
    line these are one group of mutually exclusive flags."""

    json: dict | str | None = option(
        None,
        "the output is JSON this schema accepts (a file, or the schema's JSON text)",
        flag="--json-schema",
        metavar="FILE_OR_JSON",
        group=STRUCTURED_TITLE,
    )
    json_object: bool = option(False, "the output is a JSON object", form=ENABLE, group=STRUCTURED_TITLE)
    regex: str | None = option(None, "the whole output matches this regular expression", group=STRUCTURED_TITLE)
    choice: tuple[str, ...] | None = option(
        None, "the output is one of these (repeatable)", form=APPEND, group=STRUCTURED_TITLE
    )
    grammar: str | None = option(None, "a Lark grammar (llguidance's dialect)", metavar="FILE", group=STRUCTURED_TITLE)

    def __post_init__(self):
        if self.choice is not None:
            object.__setattr__(
                self, "choice", tuple(self.choice) if isinstance(self.choice, (list, tuple)) else self.choice
            )
        set_ = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(
                f"StructuredOutput: set exactly one of json, json_object, regex, choice, grammar (got {set_ or 'none'})"
            )
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: nested too deeply
                raise ValueError(f"StructuredOutput.json: not valid JSON ({e})") from None
            object.__setattr__(self, "json", schema)
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"StructuredOutput.json: a JSON schema must be an object, got {self.json!r:.60}")
        if self.json_object is not False and self.json_object is not True:
            raise ValueError(f"StructuredOutput.json_object={self.json_object!r}: must be a bool")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"StructuredOutput.{name}={value!r:.60}: must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, tuple)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(
                f"StructuredOutput.choice={self.choice!r:.60}: must be a non-empty list of non-empty strings"
            )

    @property
    def kind(self) -> str:
        return next(f.name for f in dataclasses.fields(self) if getattr(self, f.name) not in (None, False))

    def __hash__(self) -> int:  # a schema dict is not hashable; its canonical text is
        return hash(json.dumps(dataclasses.asdict(self), sort_keys=True, default=str))
