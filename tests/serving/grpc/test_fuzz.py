"""Property-based fuzzing of gRPC Generate requests over a real loopback socket: every request
ends in a result or in INVALID_ARGUMENT naming the field; the server keeps serving and every KV
page is free afterwards."""

import grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from serving_support import assert_pages_free, client_of

from serving.grpc.proto import jaxinfer_pb2 as pb

INT32 = st.integers(-(2**31), 2**31 - 1)
FIELD_NAMES = {f.name for f in pb.SamplingOptions.DESCRIPTOR.fields}
sampling = st.fixed_dictionaries(
    {},
    optional={
        "n": st.one_of(st.integers(1, 3), INT32),
        "max_tokens": st.one_of(st.integers(1, 6), INT32),
        "temperature": st.one_of(st.floats(0, 2), st.floats()),
        "top_k": st.one_of(st.integers(-1, 40), INT32),
        "top_p": st.one_of(st.floats(0.05, 1), st.floats()),
        "min_p": st.floats(),
        "repetition_penalty": st.one_of(st.floats(0.5, 2), st.floats()),
        "presence_penalty": st.floats(),
        "frequency_penalty": st.floats(),
        "seed": st.integers(-(2**63), 2**63 - 1),
        "stop": st.lists(st.text(max_size=3), max_size=2),
        "stop_token_ids": st.lists(INT32, max_size=2),
        "ignore_eos": st.booleans(),
        "logprobs": st.one_of(st.integers(0, 20), INT32),
    },
)
prompts = st.one_of(
    st.lists(st.integers(1, 255), min_size=1, max_size=30),
    st.lists(INT32, max_size=4),
    st.lists(st.integers(1, 9), min_size=250, max_size=260),
)


def request(prompt, options, priority, request_id):
    req = pb.GenerateRequest(request_id=request_id, priority=priority, sampling=pb.SamplingOptions(**options))
    req.token_ids.ids.extend(prompt)
    return req


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_generate_ends_in_a_result_or_a_named_invalid_argument(serve, data):
    server = serve()  # one engine: a server left running would share it with the next
    engine = server.server.engine_loop.engine
    try:
        with client_of(server) as client:
            for i in range(3):  # a few requests per server: start-up is the slow part
                prompt, options = data.draw(prompts), data.draw(sampling)
                priority = data.draw(st.one_of(st.just(0), INT32))
                try:
                    replies = list(client.stub.Generate(request(prompt, options, priority, f"fuzz{i}"), timeout=60))
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
                    field = e.details().split(":")[0].split("=")[0].split(".")
                    assert field[0] in ("sampling", "token_ids", "priority", "prompt"), e.details()
                    if field[0] == "sampling":
                        assert field[1] in FIELD_NAMES, e.details()
                    event("refused")
                else:
                    event("served")
                    assert replies and all(o.finish_reason for o in replies[-1].outputs)
            assert client.generate([1, 2, 3], max_tokens=2).token_ids  # still serving
    finally:
        server.stop()
    assert_pages_free(engine)
