"""Background compilation (EngineConfig.compile_in_background, jaxinfer/worker/background.py): the
engine serves once a first request's buckets are compiled (the smallest and a prompt's);
requests that come before the rest are served within the ready buckets, each step padded to
the smallest ready one (greedy tokens those of an engine that compiled everything first),
nothing compiles on the engine's thread, windows start once their variants are in; behind a
server, health is SERVING and the metrics show the progress."""

from __future__ import annotations

import threading
import urllib.request

import jax
import openai
import pytest
from engine_runs import run_requests
from serving_support import assert_pages_free
from testpaths import FIXTURES

from jaxinfer import LLM, SamplingParams
from jaxinfer.worker import background, compiled_step, warm_up
from serving.server import BackgroundServer, ServerOptions

MODEL = str(FIXTURES / "hf" / "llama3")
OPTIONS = dict(
    dtype="float32",
    max_model_len=128,
    num_pages=48,
    max_num_seqs=8,
    max_num_batched_tokens=16,
    token_buckets=(4, 8, 16),
    num_decode_steps=4,
    compilation_cache_dir=None,
    executable_cache_dir=None,
)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 200 + 1 for j in range(5 + 9 * i)] for i in range(6)]  # 5 .. 50 tokens


@pytest.fixture(scope="module")
def strict_tokens():
    llm = LLM(MODEL, **OPTIONS)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture
def gate(monkeypatch):
    """Holds the background thread before each group until the test sets the event."""
    go = threading.Event()

    class Gated(background.BackgroundCompile):
        def __init__(self, pending, compile_group, ready_tokens, num_ready):
            super().__init__(pending, lambda group: go.wait() and compile_group(group), ready_tokens, num_ready)

    monkeypatch.setattr(compiled_step, "BackgroundCompile", Gated)
    return go


def test_groups_go_bucket_by_bucket_then_windows_and_twins():
    class Inputs:
        def __init__(self, bucket, spec=None):
            self.token_ids, self.spec = jax.ShapeDtypeStruct((bucket,), "int32"), spec

    a, b, b_hist, b_verify = Inputs(4), Inputs(16), Inputs(16), Inputs(16, spec=True)
    window, twin = Inputs(4), Inputs(4)
    variants = [
        (b, 1, False),
        (a, 1, False),
        (b_hist, 1, False),
        (b_verify, 1, True),
        (window, 4, False),
        (twin, 4, True),
    ]
    assert background.groups(variants) == [
        (4, [(a, 1, False)]),
        (16, [(b, 1, False), (b_hist, 1, False), (b_verify, 1, True)]),
        (None, [(window, 4, False), (twin, 4, True)]),
    ]


def test_a_first_request_s_buckets_come_first():
    def order(buckets, windows=True):
        first, rest = background.serving_order([(b, [b]) for b in buckets] + ([(None, ["w"])] if windows else []))
        return [b for b, _ in first], [b for b, _ in rest]

    assert background.FIRST_PROMPT_TOKENS == 64
    assert order([1, 2, 4, 8, 16, 32, 64, 128, 256, 512]) == ([1, 64], [2, 4, 8, 16, 32, 128, 256, 512, None])
    assert order([1, 16, 100, 200]) == ([1, 100], [16, 200, None])
    assert order([4, 8, 16]) == ([4, 16], [8, None])  # no bucket holds 64 tokens: the largest
    assert order([8]) == ([8], [None])
    assert order([16, 128], windows=False) == ([16, 128], [])


def test_requests_before_the_rest_are_served_within_the_ready_buckets(gate, strict_tokens):
    llm = LLM(MODEL, compile_in_background=True, **OPTIONS)
    engine, step = llm.engine, llm.engine.worker.step
    assert step.ready_tokens == 16 and not step.complete
    groups = background.groups(warm_up.step_variants(step))
    assert [bucket for bucket, _ in groups] == [4, 8, 16, None]  # then the 4-token bucket's window
    ready = len(groups[0][1]) + len(groups[2][1])  # the smallest bucket's and the largest's
    assert engine.worker.compile_progress() == (ready, sum(len(g) for _, g in groups))
    compiled_on = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: (
            compiled_on.append(threading.current_thread().name) if name.endswith("backend_compile_duration") else None
        )
    )
    planned = []
    execute = engine.worker.execute

    def watch(plans, previous=None, **kw):
        tokens = plans[0].num_batched_tokens
        planned.append((tokens, plans[0].num_steps, step.ready_tokens, step.inputs.bucket_for(max(tokens, 1))))
        return execute(plans, previous, **kw)

    engine.worker.execute = watch
    early = run_requests(engine, [(PROMPTS[0], GREEDY)])  # 5 tokens: the 8-token bucket is not in yet
    assert list(early[0].outputs[0].token_ids) == strict_tokens[0]
    assert (5, 1, 16, 16) in planned and all(bucket in (4, 16) for *_, bucket in planned), planned
    gate.set()  # the rest compiles while the requests run
    outs = run_requests(engine, [(p, GREEDY) for p in PROMPTS])
    assert [list(o.outputs[0].token_ids) for o in outs] == strict_tokens
    assert all(tokens <= cap for tokens, _, cap, _ in planned), planned  # never past the ready buckets
    assert step.background.join(300) and step.background.error is None and step.complete
    assert "MainThread" not in compiled_on  # the engine's thread compiled nothing
    # Once everything is in: the configured limits, windows planned, nothing compiles any more.
    compiles = len(compiled_on)
    outs = run_requests(engine, [(p, GREEDY) for p in PROMPTS])
    assert [list(o.outputs[0].token_ids) for o in outs] == strict_tokens
    assert engine.scheduler.max_num_batched_tokens == 16 and engine.scheduler.max_num_seqs == 8
    assert any(steps == 4 for _, steps, _, _ in planned[-20:])
    assert len(compiled_on) == compiles  # the jit finds each variant the thread compiled
    assert_pages_free(engine)


def test_a_server_is_serving_before_every_variant_is_in(gate, strict_tokens):
    llm = LLM(MODEL, compile_in_background=True, **OPTIONS)
    step = llm.engine.worker.step
    with BackgroundServer(llm.engine, ServerOptions(port=None, http_port=0, grace_period_s=2.0)) as server:
        base = f"http://127.0.0.1:{server.http_port}"
        assert urllib.request.urlopen(f"{base}/health", timeout=10).status == 200

        def progress() -> tuple[float, float]:
            text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
            values = {
                line.split()[0]: float(line.split()[1])
                for line in text.splitlines()
                if line.startswith("jaxinfer_step_variants")
            }
            return values["jaxinfer_step_variants_ready"], values["jaxinfer_step_variants_total"]

        ready, total = llm.engine.worker.compile_progress()
        assert progress() == (ready, total) and ready < total  # held: only a first request's buckets are in
        http = openai.OpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0)
        first = http.completions.create(
            model="llama3", prompt=PROMPTS[3], max_tokens=10, temperature=0, extra_body={"ignore_eos": True}, logprobs=0
        )
        assert [int(t.removeprefix("token_id:")) for t in first.choices[0].logprobs.tokens] == strict_tokens[3]
        assert progress() == (ready, total) and not step.complete  # answered from those buckets alone
        gate.set()
        assert step.background.join(300) and step.complete
        assert progress() == (total, total)
    assert_pages_free(llm.engine)


def test_an_engine_without_it_compiles_everything_first():
    llm = LLM(MODEL, **OPTIONS)
    assert llm.engine.worker.step.background is None and llm.engine.worker.step.complete
    ready, total = llm.engine.worker.compile_progress()
    assert ready == total > 0
