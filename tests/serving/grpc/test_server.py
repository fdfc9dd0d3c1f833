"""The server over a real loopback socket on the tiny Llama fixture: parity with LLM.generate,
64 concurrent streams, cancel / deadline / backpressure / bad input / failures, each followed by
a normal request, pages freed, graceful stop, health, reflection, metrics, the async client."""

import asyncio
import threading
import urllib.request

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from serving_support import assert_pages_free, client_of, slow_steps, wait_for

from jaxinfer.sampling import SamplingParams
from serving.grpc import convert
from serving.grpc.client import AsyncClient, build_request

PROMPTS = [[1, 2, 3, 4, 5], [7] * 20, list(range(10, 50)), [300, 301], list(range(100, 170))]
SETTINGS = [  # (sampling kwargs for the client == SamplingParams fields)
    dict(temperature=0.0, max_tokens=12, ignore_eos=True),
    dict(temperature=0.9, top_k=50, seed=7, max_tokens=20, ignore_eos=True, logprobs=3),
    dict(temperature=1.0, top_p=0.8, min_p=0.05, seed=123, max_tokens=9, ignore_eos=True),
    dict(
        temperature=0.7,
        seed=5,
        max_tokens=16,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.2,
        ignore_eos=True,
    ),
    dict(temperature=0.0, max_tokens=30, stop_token_ids=[175, 420], logprobs=1),
]


def normal_request_works(server):
    with client_of(server) as client:
        result = client.generate([1, 2, 3], max_tokens=4, temperature=0, ignore_eos=True, timeout=30)
    assert len(result.token_ids) == 4 and result.outputs[0].finish_reason == "length"


def rpc_error(fn, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kwargs)
    return info.value


@pytest.fixture(scope="module")
def expected(tiny_llm):
    """LLM.generate's outputs for PROMPTS x SETTINGS, computed before any server owns the engine."""
    params = [SamplingParams(**s) for s in SETTINGS for _ in PROMPTS]
    outs = tiny_llm.generate([p for _ in SETTINGS for p in PROMPTS], params, use_tqdm=False)
    return {(i, j): outs[i * len(PROMPTS) + j].outputs[0] for i in range(len(SETTINGS)) for j in range(len(PROMPTS))}


def test_streamed_output_equals_llm_generate(serve, expected):
    server = serve()
    with client_of(server) as client:
        for (i, j), want in expected.items():
            messages = list(client.stream(PROMPTS[j], timeout=60, **SETTINGS[i]))
            assert messages[-1].finished and not any(m.finished for m in messages[:-1])
            got = [t for m in messages for t in m.outputs[0].token_ids]
            assert got == want.token_ids, (i, j)
            assert messages[-1].outputs[0].finish_reason == want.finish_reason
            if want.logprobs is not None:  # the batch differs: logprobs agree to float rounding
                lps = [lp for m in messages for lp in m.outputs[0].logprobs]
                assert [lp.token_id for lp in lps] == [lp.token_id for lp in want.logprobs]
                assert [lp.logprob for lp in lps] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
                assert [dict((t.token_id, t.logprob) for t in lp.top) for lp in lps] == [
                    pytest.approx(lp.top, abs=1e-4) for lp in want.logprobs
                ]
            final = messages[-1]
            assert final.usage.prompt_tokens == len(PROMPTS[j])
            assert final.usage.completion_tokens == len(want.token_ids)
            assert 0 < final.timings.time_to_first_token_s <= final.timings.e2e_latency_s


def test_64_concurrent_streaming_clients(serve, expected):
    server = serve()

    async def run_all():
        async with AsyncClient(server.address) as client:

            async def one(k):
                i, j = k % len(SETTINGS), (k // len(SETTINGS)) % len(PROMPTS)
                tokens, n_messages = [], 0
                async for msg in client.stream(PROMPTS[j], timeout=120, **SETTINGS[i]):
                    tokens += msg.outputs[0].token_ids
                    n_messages += 1
                return (i, j), tokens, n_messages

            return await asyncio.gather(*(one(k) for k in range(64)))

    results = asyncio.run(run_all())
    assert len(results) == 64
    for key, tokens, n_messages in results:
        assert tokens == expected[key].token_ids, key
        assert n_messages >= 1
    with client_of(server) as client:
        stats = client.server_stats()
    assert stats.kv_pages_free == stats.kv_pages_total and stats.running == stats.waiting == 0
    assert stats.active_streams == 0


def test_n_samples_and_request_id(serve):
    server = serve()
    with client_of(server) as client:
        result = client.generate(
            [5, 6, 7], n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True, request_id="mine-1"
        )
    assert result.request_id == "mine-1"
    assert [c.index for c in result.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in result.outputs)
    assert result.usage.completion_tokens == 18


def test_cancel_mid_stream_frees_pages(serve):
    server = serve()
    engine = server.server.engine_loop.engine
    with client_of(server) as client, slow_steps(engine, 0.01):
        stream = client.stream(list(range(1, 40)), max_tokens=200, temperature=0, ignore_eos=True)
        first = next(stream)
        assert first.outputs[0].token_ids
        stats = client.server_stats()
        assert stats.kv_pages_free < stats.kv_pages_total and stats.active_streams == 1
        stream.close()  # cancels the call
        stats = wait_for(lambda: (s := client.server_stats()).kv_pages_free == s.kv_pages_total and s)
        assert stats.running == 0 and stats.waiting == 0
    wait_for(lambda: server.server.servicer.num_streams == 0)
    normal_request_works(server)


def test_client_disconnect_aborts_the_request(serve):
    server = serve()
    engine = server.server.engine_loop.engine
    with slow_steps(engine, 0.01):
        with client_of(server) as client:
            stream = client.stream([1, 2, 3], max_tokens=200, temperature=0, ignore_eos=True)
            next(stream)
        # the channel is closed without reading on: the server sees the call cancelled
        with client_of(server) as probe:
            wait_for(lambda: (s := probe.server_stats()).kv_pages_free == s.kv_pages_total and s.running == 0)
    normal_request_works(server)


def test_deadline_exceeded(serve):
    server = serve()
    engine = server.server.engine_loop.engine
    with client_of(server) as client, slow_steps(engine, 0.02):
        err = rpc_error(client.generate, [1, 2, 3], max_tokens=200, temperature=0, ignore_eos=True, timeout=0.5)
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for(lambda: (s := client.server_stats()).kv_pages_free == s.kv_pages_total and s.running == 0)
    normal_request_works(server)


def test_backpressure_resource_exhausted(serve):
    server = serve(max_waiting=2)  # 8 running + 2 waiting admitted
    engine = server.server.engine_loop.engine
    assert server.server.servicer.max_in_flight == 10
    with client_of(server) as client, slow_steps(engine, 0.02):
        calls = [
            client.stub.Generate(
                build_request([1, 2, 3, k], max_tokens=200, temperature=0, ignore_eos=True), timeout=60
            )
            for k in range(10)
        ]
        wait_for(lambda: client.server_stats().active_streams == 10)
        err = rpc_error(client.generate, [9, 9], max_tokens=2)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry later" in err.details()
        for call in calls:
            call.cancel()
        wait_for(lambda: client.server_stats().active_streams == 0)
    normal_request_works(server)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(prompt=[1, 2], top_p=2.0), "sampling.top_p"),
        (dict(prompt=[1, 2], n=0), "sampling.n"),
        (dict(prompt=[1, 2], max_tokens=-1), "sampling.max_tokens"),
        (dict(prompt=[1, 2], temperature=-1.0), "sampling.temperature"),
        (dict(prompt=[1, 2], logprobs=50), "sampling.logprobs"),
        (dict(prompt=[1, 2], stop=[""]), "sampling.stop"),
        (dict(prompt=[1, 2, 9999]), "token_ids.ids"),
        (dict(prompt=[1, -5]), "token_ids.ids"),
        (dict(prompt=[]), "token_ids.ids"),
        (dict(prompt="hello"), "text"),  # this model has no tokenizer
        (dict(messages=[{"role": "user", "content": "hi"}]), "chat"),
        (dict(prompt=list(range(1, 300))), "token_ids"),  # longer than max_model_len=256
        (dict(prompt=list(range(1, 200)), max_tokens=100), "sampling.max_tokens"),  # together too long
        (dict(prompt=[1, 2], n=65), "sampling.n=65: exceeds this server's max_n=64"),
        (dict(prompt=[1, 2], temperature=1e300), "sampling.temperature"),
        (dict(prompt=[1, 2], logit_bias={9999: 1.0}), "sampling.logit_bias[9999]: token ids out of the vocabulary"),
        (dict(prompt=[1, 2], logit_bias={5: -100.5}), "sampling.logit_bias[5]=-100.5"),
        (
            dict(prompt=[1, 2], prompt_logprobs=1),
            "sampling.prompt_logprobs=1: prompt logprobs are off on this "
            "server (start it with --enable-prompt-logprobs)",
        ),
        (dict(prompt=[1, 2], prompt_logprobs=-1), "sampling.prompt_logprobs=-1"),
    ],
)
def test_invalid_argument_names_the_field(serve, kwargs, field):
    server = serve()
    with client_of(server) as client:
        err = rpc_error(client.generate, timeout=30, **kwargs)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(field), err.details()
    normal_request_works(server)


def test_request_without_prompt_and_duplicate_id(serve):
    server = serve()
    engine = server.server.engine_loop.engine
    with client_of(server) as client, slow_steps(engine, 0.01):
        err = rpc_error(lambda: list(client.stub.Generate(convert.pb.GenerateRequest(), timeout=30)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("prompt")
        stream = client.stream([1, 2], request_id="dup", max_tokens=100, ignore_eos=True)
        next(stream)
        err = rpc_error(client.generate, [1, 2], request_id="dup")
        assert err.code() == grpc.StatusCode.ALREADY_EXISTS
        stream.close()
    normal_request_works(server)


def test_huge_prompt_message_is_refused_by_size(serve):
    server = serve()
    with client_of(server) as client:
        err = rpc_error(client.generate, [300] * 2_500_000, timeout=60)  # ~5 MB > the 4 MiB limit
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    normal_request_works(server)


def test_exception_in_one_request_fails_only_that_request(serve, monkeypatch):
    server = serve()
    engine = server.server.engine_loop.engine
    real_response, real_add = convert.response, engine.add_request

    def response(out, replies=None):
        if out.request_id == "bad-output":
            raise RuntimeError("injected conversion failure")
        return real_response(out, replies)

    def add_request(request, *, request_id, **kw):
        if request_id == "bad-add":
            raise RuntimeError("injected add failure")
        return real_add(request, request_id=request_id, **kw)

    monkeypatch.setattr(convert, "response", response)
    monkeypatch.setattr(engine, "add_request", add_request)
    results = {}

    def run(rid):
        try:
            with client_of(server) as c:
                results[rid] = c.generate(
                    [4, 5, 6], request_id=rid, max_tokens=20, temperature=0, ignore_eos=True, timeout=60
                )
        except grpc.RpcError as e:
            results[rid] = e

    ids = ["ok-1", "bad-output", "ok-2", "bad-add", "ok-3"]
    threads = [threading.Thread(target=run, args=(rid,)) for rid in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for rid in ("bad-output", "bad-add"):
        assert isinstance(results[rid], grpc.RpcError) and results[rid].code() == grpc.StatusCode.INTERNAL
        assert "injected" in results[rid].details()
    assert all(len(results[rid].token_ids) == 20 for rid in ("ok-1", "ok-2", "ok-3"))
    monkeypatch.undo()
    normal_request_works(server)


def test_failing_engine_step_fails_its_requests_and_the_server_goes_on(serve):
    server = serve()
    engine = server.server.engine_loop.engine
    real_step, calls = engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected step failure")
        return real_step()

    engine.step = step
    try:
        with client_of(server) as client:
            err = rpc_error(client.generate, [1, 2, 3], max_tokens=50, ignore_eos=True, timeout=30)
        assert err.code() == grpc.StatusCode.INTERNAL and "injected step failure" in err.details()
    finally:
        del engine.step
    # a failed step may leave the engine's bookkeeping torn; the request was aborted all the same
    wait_for(lambda: not engine.has_unfinished() or None)
    normal_request_works(server)


def test_graceful_stop_lets_requests_finish_or_ends_them_unavailable(serve):
    server = serve()
    engine = server.server.engine_loop.engine
    outcome = {}

    def run(name, max_tokens):
        try:
            with client_of(server) as c:
                outcome[name] = c.generate([1, 2, 3], max_tokens=max_tokens, temperature=0, ignore_eos=True, timeout=60)
        except grpc.RpcError as e:
            outcome[name] = e

    with slow_steps(engine, 0.1):  # a step may be a decode window of 8 tokens
        threads = [threading.Thread(target=run, args=("short", 10)), threading.Thread(target=run, args=("long", 250))]
        for t in threads:
            t.start()
        wait_for(lambda: server.server.servicer.num_streams == 2)
        server.stop(grace=1.0)  # "short" needs ~0.3 s (3 steps), "long" over 3 s (32 steps)
        for t in threads:
            t.join(30)
    assert len(outcome["short"].token_ids) == 10
    assert outcome["long"].code() == grpc.StatusCode.UNAVAILABLE
    assert_pages_free(engine)


def test_health_model_info_and_stats(serve):
    server = serve()
    with client_of(server) as client:
        assert client.health() == "SERVING"
        assert client.health("jaxinfer.v1.InferenceService") == "SERVING"
        info = client.model_info()
        assert (info.vocab_size, info.max_model_len, info.has_tokenizer) == (512, 256, False)
        assert info.kv_pages_total == 47 and info.max_num_seqs == 8 and info.penalties_enabled
        # 2 buckets x (with, without penalty history) + the decode window of the 8-token bucket
        # + the page table's scatter at 2 widths (64 entries, and 512 >= 8 slots x 16 pages)
        assert client.server_stats().compiled_variants == 7
        err = rpc_error(client.tokenize, "hello")
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_reflection_lists_the_services(serve):
    server = serve()
    with grpc.insecure_channel(server.address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {"jaxinfer.v1.InferenceService", "grpc.health.v1.Health"} <= services
        service = descriptor_pool.DescriptorPool(database).FindServiceByName("jaxinfer.v1.InferenceService")
        assert {m.name for m in service.methods} == {
            "Generate",
            "Tokenize",
            "Detokenize",
            "GetModelInfo",
            "GetServerStats",
            "ListLoraAdapters",
            "LoadLoraAdapter",
            "UnloadLoraAdapter",
        }
        assert service.methods_by_name["Generate"].server_streaming


def test_prometheus_metrics(serve):
    server = serve(metrics_port=0)
    with client_of(server) as client:
        for k in range(3):
            client.generate([1, 2, 3 + k], max_tokens=5, temperature=0, ignore_eos=True)
        rpc_error(client.generate, [1], top_p=5.0)
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics", timeout=10).read().decode()
    samples = {
        line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and not line.startswith("#")
    }
    assert samples["jaxinfer_time_to_first_token_seconds_count"] == 3
    assert samples["jaxinfer_e2e_request_latency_seconds_count"] == 3
    assert samples["jaxinfer_request_queue_time_seconds_count"] == 3
    assert samples["jaxinfer_inter_token_latency_seconds_count"] == 12
    assert samples["jaxinfer_generation_tokens_total"] == 15
    assert samples["jaxinfer_prompt_tokens_total"] == 9
    assert samples['jaxinfer_requests_total{finish_reason="length"}'] == 3
    assert samples['jaxinfer_rejected_requests_total{code="INVALID_ARGUMENT"}'] == 1
    for name in (
        "jaxinfer_num_requests_running",
        "jaxinfer_num_requests_waiting",
        "jaxinfer_kv_cache_usage_ratio",
        "jaxinfer_preemptions_total",
        "jaxinfer_prefix_cache_hits_total",
        "jaxinfer_generation_tokens_per_second",
    ):
        assert name in samples
    assert samples["jaxinfer_generation_tokens_per_second"] > 0


def test_async_client_unary_calls(serve):
    server = serve()

    async def calls():
        async with AsyncClient(server.address) as client:
            assert await client.health() == "SERVING"
            info = await client.model_info()
            result = await client.generate([1, 2, 3], max_tokens=3, temperature=0, ignore_eos=True)
            stats = await client.server_stats()
            return info, result, stats

    info, result, stats = asyncio.run(calls())
    assert info.vocab_size == 512 and len(result.token_ids) == 3 and stats.kv_pages_free == stats.kv_pages_total


def test_beam_search_over_grpc(serve, tiny_llm):
    """GenerateRequest.beam_search: the final response holds LLM.beam_search's beams, best first;
    a sampling option beam search cannot honour is INVALID_ARGUMENT naming it."""
    from jaxinfer.sampling.beam import BeamSearchParams

    prompt = list(range(40, 61))
    (want,) = tiny_llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=2.0))
    server = serve()
    pb = convert.pb
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingOptions(max_tokens=6),
        beam_search=pb.BeamSearch(beam_width=3, length_penalty=2.0),
    )
    with client_of(server) as client:
        responses = list(client.stub.Generate(request, timeout=60))
        final = responses[-1]
        assert final.finished and [o.index for o in final.outputs] == [0, 1, 2]
        assert [list(o.token_ids) for o in final.outputs] == [s.token_ids for s in want.sequences]
        request.sampling.top_p = 0.5
        err = rpc_error(lambda: list(client.stub.Generate(request, timeout=30)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("sampling.top_p")
        request.sampling.ClearField("top_p")
        request.beam_search.beam_width = 0
        err = rpc_error(lambda: list(client.stub.Generate(request, timeout=30)))
        assert err.details().startswith("beam_search.beam_width=0"), err.details()
    normal_request_works(server)
