"""The committed generated code is what grpcio-tools makes of the proto, and the proto carries
every SamplingParams field; request conversion names the bad field."""
import dataclasses
from pathlib import Path

import pytest

from jaxinfer.sampling import SamplingParams
from serving import convert
from serving.proto import jaxinfer_pb2 as pb
from serving.proto import regen

PROTO_DIR = Path(regen.__file__).parent


def test_generated_code_matches_the_proto(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools==1.85.1 (the test extra) regenerates the stubs")
    for generated in regen.generate(tmp_path):
        committed = PROTO_DIR / generated.name
        assert generated.read_text() == committed.read_text(), (
            f"{committed} is stale: run `python -m serving.proto.regen` and commit the result")


def test_sampling_options_cover_every_sampling_param():
    proto_fields = {f.name for f in pb.SamplingOptions.DESCRIPTOR.fields}
    assert proto_fields == {f.name for f in dataclasses.fields(SamplingParams)}


def test_unset_options_take_sampling_param_defaults():
    assert convert.sampling_params(pb.SamplingOptions()) == SamplingParams()
    options = pb.SamplingOptions(n=2, max_tokens=7, temperature=0.0, top_k=5, top_p=0.5, min_p=0.1, seed=-3,
                                 stop=["a", "bc"], stop_token_ids=[4], ignore_eos=True, logprobs=0,
                                 include_stop_str_in_output=True, skip_special_tokens=False)
    assert convert.sampling_params(options) == SamplingParams(
        n=2, max_tokens=7, temperature=0.0, top_k=5, top_p=0.5, min_p=0.1, seed=-3, stop=("a", "bc"),
        stop_token_ids=(4,), ignore_eos=True, logprobs=0, include_stop_str_in_output=True,
        skip_special_tokens=False)


def test_bad_option_names_the_field():
    with pytest.raises(convert.RequestError, match=r"^sampling\.min_p=2\.0: must be in \[0, 1\]"):
        convert.sampling_params(pb.SamplingOptions(min_p=2.0))
    with pytest.raises(convert.RequestError, match=r"^sampling\.stop_token_ids"):
        convert.sampling_params(pb.SamplingOptions(stop_token_ids=[-1]))
