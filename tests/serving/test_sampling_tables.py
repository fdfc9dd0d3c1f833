"""The transports' sampling tables (serving.sampling_fields): on gRPC and on the HTTP API every
SamplingParams field is either mapped from a request field or listed as not exposed with its
reason, and every field a table names exists on both ends. A field added to SamplingParams
fails here until each transport decides about it."""

import dataclasses

import pytest

from jaxinfer.sampling import SamplingParams
from serving.grpc.convert import SAMPLING_TABLE as GRPC
from serving.grpc.proto import jaxinfer_pb2 as pb
from serving.openai.protocol import ChatCompletionRequest, CompletionRequest
from serving.openai.sampling_table import SAMPLING_TABLE as HTTP
from serving.sampling_fields import FieldMapping, NotExposed, SamplingTable

PARAMS = [f.name for f in dataclasses.fields(SamplingParams)]
TRANSPORT_FIELDS = {
    "grpc": {f.name for f in pb.SamplingOptions.DESCRIPTOR.fields},
    "http": set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields),
}
TABLES = {"grpc": GRPC, "http": HTTP}


@pytest.mark.parametrize("transport", sorted(TABLES))
def test_every_sampling_param_is_mapped_or_left_out_with_a_reason(transport):
    table = TABLES[transport]
    assert table.undecided(PARAMS) == [], f"{table.transport}: decide about these SamplingParams fields"
    assert table.unknown(PARAMS) == [], f"{table.transport}: these are not SamplingParams fields"


@pytest.mark.parametrize("transport", sorted(TABLES))
def test_mapped_request_fields_exist_on_the_transport(transport):
    named = {name for m in TABLES[transport].mapped for name in m.transport}
    assert named - TRANSPORT_FIELDS[transport] == set()


def test_a_new_sampling_param_is_undecided_until_listed():
    wider = dataclasses.make_dataclass(
        "WiderParams", [("min_tokens", int, dataclasses.field(default=0))], bases=(SamplingParams,), frozen=True
    )
    names = [f.name for f in dataclasses.fields(wider)]
    for table in TABLES.values():
        assert table.undecided(names) == ["min_tokens"]
        decided = dataclasses.replace(
            table, not_exposed=table.not_exposed + (NotExposed("min_tokens", "not offered on this transport yet"),)
        )
        assert decided.undecided(names) == []


def test_a_table_refuses_double_decisions_and_silent_omissions():
    with pytest.raises(ValueError, match=r"\['n'\] decided more than once"):
        SamplingTable("t", (FieldMapping(("n",), "n"),), (NotExposed("n", "why"),))
    with pytest.raises(ValueError, match=r"\['seed'\] not exposed without a reason"):
        SamplingTable("t", (), (NotExposed("seed", " "),))


def test_the_conversions_read_the_tables():
    from serving.grpc import convert
    from serving.openai import inputs

    optional = tuple(m.params for m in GRPC.mapped if m.conversion == convert._OPTIONAL)
    assert convert._SCALAR_FIELDS == optional and len(optional) == 16  # copied when set, by name
    assert inputs._SAME_NAME == HTTP.same_name() and len(inputs._SAME_NAME) == 14
    assert HTTP.mapping("max_tokens").transport == ("max_tokens", "max_completion_tokens")
