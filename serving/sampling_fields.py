"""The transports' sampling tables: which request field becomes which SamplingParams field, and
which SamplingParams fields a transport deliberately leaves out, each with its reason.

SamplingParams (jaxinfer/sampling/params.py) is the one source of sampling options. Each transport
keeps one SamplingTable beside its conversion code (serving.grpc.convert.SAMPLING_TABLE,
serving.openai.sampling_table.SAMPLING_TABLE), and the conversion reads it, so the table is what
the transport does, not a description of it. tests/serving/test_sampling_tables.py fails when a
SamplingParams field is in neither half of a table: a new field forces a decision on every
transport.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

AS_IS = "as is"  # the request's value is the SamplingParams value (SamplingParams checks it)


@dataclasses.dataclass(frozen=True)
class FieldMapping:
    """Request field(s) -> one SamplingParams field, and how the value is converted."""

    transport: tuple[str, ...]  # the request's field names (several: alternatives or a combination)
    params: str  # the SamplingParams field
    conversion: str = AS_IS  # how the value becomes the field's (AS_IS: unchanged)

    @property
    def same_name(self) -> bool:
        """One request field of the SamplingParams field's name, taken as is."""
        return self.transport == (self.params,) and self.conversion == AS_IS


@dataclasses.dataclass(frozen=True)
class NotExposed:
    """A SamplingParams field a transport deliberately does not offer."""

    params: str
    reason: str


@dataclasses.dataclass(frozen=True)
class SamplingTable:
    transport: str  # for messages: "gRPC SamplingOptions", "HTTP request body"
    mapped: tuple[FieldMapping, ...]
    not_exposed: tuple[NotExposed, ...] = ()

    def __post_init__(self):
        mapped = [m.params for m in self.mapped]
        left_out = [n.params for n in self.not_exposed]
        twice = sorted({name for name in mapped + left_out if (mapped + left_out).count(name) > 1})
        if twice:
            raise ValueError(f"{self.transport} sampling table: {twice} decided more than once")
        unexplained = [n.params for n in self.not_exposed if not n.reason.strip()]
        if unexplained:
            raise ValueError(f"{self.transport} sampling table: {unexplained} not exposed without a reason")

    def same_name(self) -> tuple[str, ...]:
        """The fields a request names as SamplingParams does and that are taken as they are."""
        return tuple(m.params for m in self.mapped if m.same_name)

    def mapping(self, params_field: str) -> FieldMapping:
        return next(m for m in self.mapped if m.params == params_field)

    def undecided(self, params_fields: Iterable[str]) -> list[str]:
        """The given SamplingParams fields this table neither maps nor lists as not exposed."""
        decided = {m.params for m in self.mapped} | {n.params for n in self.not_exposed}
        return [name for name in params_fields if name not in decided]

    def unknown(self, params_fields: Iterable[str]) -> list[str]:
        """The table's SamplingParams fields that are not among `params_fields` (renamed or gone)."""
        known = set(params_fields)
        return [
            name for name in [m.params for m in self.mapped] + [n.params for n in self.not_exposed] if name not in known
        ]
