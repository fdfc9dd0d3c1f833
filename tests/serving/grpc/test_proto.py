"""The committed generated code is what grpcio-tools makes of the proto, and the proto carries
every SamplingParams field; request conversion names the bad field."""

import dataclasses
from pathlib import Path

import pytest

from jaxinfer.sampling import SamplingParams
from serving.errors import RequestError
from serving.grpc import convert
from serving.grpc.proto import jaxinfer_pb2 as pb
from serving.grpc.proto import regen
from serving.model_limits import ModelLimits, check_params

PROTO_DIR = Path(regen.__file__).parent


def test_generated_code_matches_the_proto(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools==1.85.1 (the test extra) regenerates the stubs")
    for generated in regen.generate(tmp_path):
        committed = PROTO_DIR / generated.name
        assert generated.read_text() == committed.read_text(), (
            f"{committed} is stale: run `python -m serving.grpc.proto.regen` and commit the result"
        )


def test_sampling_options_cover_every_sampling_param():
    proto_fields = {f.name for f in pb.SamplingOptions.DESCRIPTOR.fields}
    assert proto_fields == {f.name for f in dataclasses.fields(SamplingParams)}


def test_unset_options_take_sampling_param_defaults():
    assert convert.sampling_params(pb.SamplingOptions()) == SamplingParams()
    options = pb.SamplingOptions(
        n=2,
        max_tokens=7,
        temperature=0.0,
        top_k=5,
        top_p=0.5,
        min_p=0.1,
        seed=-3,
        stop=["a", "bc"],
        stop_token_ids=[4],
        ignore_eos=True,
        logprobs=0,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
    )
    assert convert.sampling_params(options) == SamplingParams(
        n=2,
        max_tokens=7,
        temperature=0.0,
        top_k=5,
        top_p=0.5,
        min_p=0.1,
        seed=-3,
        stop=("a", "bc"),
        stop_token_ids=(4,),
        ignore_eos=True,
        logprobs=0,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
    )


def test_bad_option_names_the_field():
    with pytest.raises(RequestError, match=r"^sampling\.min_p=2\.0: must be in \[0, 1\]"):
        convert.sampling_params(pb.SamplingOptions(min_p=2.0))
    with pytest.raises(RequestError, match=r"^sampling\.stop_token_ids"):
        convert.sampling_params(pb.SamplingOptions(stop_token_ids=[-1]))


def test_logit_bias_round_trips_and_is_checked():
    from jaxinfer.sampling import StructuredOutput

    params = SamplingParams(
        n=2,
        temperature=0.5,
        seed=3,
        stop=("x",),
        logprobs=2,
        logit_bias={5: -100, 7: 0.1},
        structured_output=StructuredOutput(regex="a+"),
    )
    options = convert.sampling_options(params)
    assert dict(options.logit_bias) == {5: -100.0, 7: 0.1}
    assert convert.sampling_params(options) == params
    assert pb.SamplingOptions.FromString(options.SerializeToString()) == options
    assert convert.sampling_params(convert.sampling_options(SamplingParams())) == SamplingParams()
    assert convert.sampling_params(pb.SamplingOptions(logit_bias={})).logit_bias is None
    with pytest.raises(RequestError, match=r"^sampling\.logit_bias\[5\]=200\.0: must be a number in"):
        convert.sampling_params(pb.SamplingOptions(logit_bias={5: 200}))
    with pytest.raises(RequestError, match=r"^sampling\.logit_bias\[-1\]: a token id"):
        convert.sampling_params(pb.SamplingOptions(logit_bias={-1: 1}))
    limits = ModelLimits(vocab_size=100, max_model_len=64, penalties_enabled=False)
    check_params(SamplingParams(logit_bias={99: 1.0}), limits, 3)
    with pytest.raises(
        RequestError,
        match=r"^sampling\.logit_bias\[100\]: token ids out of the "
        r"vocabulary \[0, 100\): \[100\]",
    ):
        check_params(SamplingParams(logit_bias={100: 1.0, 5: 2.0}), limits, 3)


def test_client_command_sends_logit_bias():
    from jaxinfer.cli import build_parser
    from serving.grpc.client import build_request
    from serving.grpc.client_cli import _generate

    sent = {}

    class FakeClient:
        def stream(self, prompt=None, **kwargs):
            sent["request"] = build_request(prompt, **{k: v for k, v in kwargs.items() if k != "timeout"})
            return []

    args = build_parser().parse_args(["client", "generate", "hi", "--logit-bias", '{"17": -100, "3": 2.5}'])
    assert _generate(FakeClient(), args) == 0
    assert dict(sent["request"].sampling.logit_bias) == {17: -100.0, 3: 2.5}
    args = build_parser().parse_args(["client", "generate", "hi"])
    _generate(FakeClient(), args)
    assert not sent["request"].sampling.logit_bias
