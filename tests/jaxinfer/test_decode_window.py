"""Decode windows (num_decode_steps > 1: k decode steps per jitted call) give exactly the tokens of
single steps, synchronous or async: chunked prefill, preemption under a tiny pool, seeded
sampling, n > 1, stop ids, stop strings and max_tokens hit mid-window, logprobs, prefix-cache
hits, aborts; every page back in the pool and nothing compiled after warm-up.

One engine per model, compiled with windows of 4 and their greedy twins (greedy_variant: an
all-greedy window runs with no conditional), its steps launched from the launcher's thread
(dispatch_thread) as on a GPU; the baseline runs with windows switched off
(`runner.step.num_decode_steps = 1`), so both sides share the same compiled steps."""

import pytest
from testpaths import FIXTURES, smollm2_gguf_path

from jaxinfer.config import EngineConfig
from jaxinfer.engine import Engine
from jaxinfer.loader import load_model
from jaxinfer.sampling import SamplingParams

K = 4


@pytest.fixture(scope="module")
def engine():
    model = load_model(FIXTURES / "hf" / "llama3", dtype="float32")
    config = EngineConfig(
        num_pages=14,
        page_size=8,
        max_num_batched_tokens=32,
        max_num_seqs=6,
        max_model_len=128,
        token_buckets=(8, 32),
        num_decode_steps=K,
        greedy_variant=True,
        dispatch_thread=True,
    )
    return Engine(model, config)


def run(engine, requests, *, windows, async_scheduling=True, abort_after=None):
    """requests: {id: (prompt, params)} -> ({id: [tokens per sample]}, {id: reasons}, {id: [logprobs]})."""
    engine.config = engine.config.replace(async_scheduling=async_scheduling)
    engine.worker.step.num_decode_steps = K if windows else 1
    window_steps = []
    dispatch = engine.worker.step.dispatch
    engine.worker.step.dispatch = lambda inputs, n=1: window_steps.append(n) or dispatch(inputs, n)
    try:
        for rid, (prompt, params) in requests.items():
            engine.add_request(prompt, params, request_id=rid)
        tokens, reasons, logprobs, steps = {}, {}, {}, 0
        while engine.has_unfinished():
            for out in engine.step():
                per = tokens.setdefault(out.request_id, [[] for _ in out.outputs])
                lps = logprobs.setdefault(out.request_id, [[] for _ in out.outputs])
                for c in out.outputs:
                    per[c.index] += c.token_ids
                    lps[c.index] += [(lp.token_id, round(lp.logprob, 4), sorted(lp.top)) for lp in c.logprobs or []]
                if out.finished:
                    reasons[out.request_id] = [c.finish_reason for c in out.outputs]
            steps += 1
            if abort_after and steps in abort_after:
                engine.abort(abort_after[steps])
    finally:
        del engine.worker.step.dispatch
    assert engine.kv_cache.num_free_pages == engine.kv_cache.num_usable_pages, "KV pages leaked"
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
    return (tokens, reasons, logprobs), window_steps


def compare(engine, requests, **kw):
    compiled = engine.worker.num_compiled()
    single, steps = run(engine, requests, windows=False, **kw)
    assert set(steps) == {1}
    for async_scheduling in (True, False):
        windowed, steps = run(engine, requests, windows=True, async_scheduling=async_scheduling, **kw)
        assert windowed == single, f"async_scheduling={async_scheduling}"
    assert engine.worker.num_compiled() == compiled, "a decode window compiled after warm-up"
    return single, steps


def prompt(seed, length):
    return [(seed * 37 + i * 11) % 250 + 1 for i in range(length)]


def test_greedy_with_chunked_prefill_and_preemption(engine):
    greedy = SamplingParams(temperature=0, max_tokens=22, ignore_eos=True)
    requests = {str(i): (prompt(i, 5 + 9 * i), greedy) for i in range(5)}  # 14 pages: preemptions
    before = engine.num_preemptions
    (tokens, _, _), steps = compare(engine, requests)
    assert engine.num_preemptions > before
    assert steps.count(K) >= 3, steps  # windows ran where every sequence decoded
    assert all(len(t[0]) == 22 for t in tokens.values())


def test_seeded_sampling_n_stops_logprobs_max_tokens(engine):
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    (base, _, _), _ = run(engine, {"s": (prompt(3, 7), greedy)}, windows=False)
    stop_id = base["s"][0][6]  # the 7th token: inside the second window
    requests = {
        "seeded": (prompt(1, 12), SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=17)),
        "n3": (prompt(2, 9), SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)),
        "stop": (prompt(3, 7), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id])),
        "logprobs": (prompt(4, 6), SamplingParams(temperature=0.7, seed=1, max_tokens=9, logprobs=3, ignore_eos=True)),
        "odd": (prompt(5, 5), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)),
    }
    (tokens, reasons, logprobs), _ = compare(engine, requests)
    assert tokens["stop"][0][-1] == stop_id and reasons["stop"] == ["stop"]
    assert len(tokens["stop"][0]) <= 7
    assert [len(t) for t in tokens["n3"]] == [10, 10, 10] and len(tokens["odd"][0]) == 6
    assert len(logprobs["logprobs"][0]) == 9 and all(len(top) == 3 for _, _, top in logprobs["logprobs"][0])


def test_all_greedy_windows_run_the_greedy_twin(engine):
    """A window whose every row is greedy and asks for nothing else runs the twin (the same
    tokens as single steps, which run the general step); one sampled row keeps the batch on the
    general window."""
    plain = []
    placed = engine.worker.step._placed
    engine.worker.step._placed = lambda inputs: plain.append(inputs.sampling.plain) or placed(inputs)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
        _, steps = compare(engine, {str(i): (prompt(i, 6 + i), greedy) for i in range(3)})
        assert plain.count(True) == 2 * steps.count(K) >= 4  # each window, async and synchronous
        plain.clear()
        sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=14, ignore_eos=True)
        _, steps = compare(engine, {"g": (prompt(1, 6), greedy), "s": (prompt(2, 7), sampled)})
        assert steps.count(K) >= 2 and not any(plain)
    finally:
        del engine.worker.step._placed


def test_penalties_run_single_steps(engine):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3)
    _, steps = compare(engine, {"p": (prompt(8, 8), params)})
    assert set(steps) == {1}  # the host keeps the penalty history: no window


def test_prefix_cache_hits(engine):
    shared = prompt(9, 40)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    requests = {"a": (shared, greedy), "b": (shared + [5, 6], greedy)}
    compare(engine, requests)


def test_context_end():
    """A sequence that fills max_model_len exactly: its last tokens cannot take a whole window."""
    model = load_model(FIXTURES / "hf" / "llama3", dtype="float32")
    config = EngineConfig(
        num_pages=20,
        page_size=8,
        max_num_batched_tokens=32,
        max_num_seqs=2,
        max_model_len=64,
        token_buckets=(2, 32),
        num_decode_steps=K,
    )
    small = Engine(model, config)
    params = SamplingParams(temperature=0, max_tokens=11, ignore_eos=True)
    (tokens, reasons, _), steps = compare(small, {"end": (prompt(10, 53), params)})
    assert len(tokens["end"][0]) == 11 and reasons["end"] == ["length"]
    assert steps.count(1) >= 2 and K in steps


def test_aborts_mid_stream_free_everything(engine):
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    requests = {"kept": (prompt(6, 10), greedy), "dropped": (prompt(7, 10), greedy)}
    single, _ = run(engine, requests, windows=False, abort_after={4: "dropped"})
    windowed, steps = run(engine, requests, windows=True, abort_after={4: "dropped"})
    assert K in steps
    assert single[0]["kept"] == windowed[0]["kept"]
    assert single[1]["dropped"] == windowed[1]["dropped"] == ["abort"]
    full, _ = run(engine, {"dropped": (prompt(7, 10), greedy)}, windows=False)
    got = windowed[0]["dropped"][0]
    assert got == full[0]["dropped"][0][: len(got)]  # an aborted stream holds a prefix


@pytest.mark.slow
def test_stop_strings_mid_window_on_smollm2():
    """Real tokenizer: a stop string inside a window ends the text there and drops the overrun."""
    model = load_model(smollm2_gguf_path(), dtype="float32")
    config = EngineConfig(
        num_pages=64,
        page_size=16,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        max_model_len=256,
        token_buckets=(4, 32),
        num_decode_steps=K,
        penalties=False,
    )
    engine = Engine(model, config)
    ids = engine.tokenizer.encode("The capital of France is")
    greedy = SamplingParams(temperature=0, max_tokens=24)
    (base, _, _), _ = run(engine, {"x": (ids, greedy)}, windows=False)
    text = engine.tokenizer.decode(base["x"][0])
    stop = text.split()[3]  # a word a few tokens in
    params = SamplingParams(temperature=0, max_tokens=24, stop=[stop])
    outs = {}
    for windows in (False, True):  # deltas accumulated: a window delivers several tokens at once
        engine.worker.step.num_decode_steps = K if windows else 1
        engine.add_request(ids, params, request_id=f"w{windows}")
        text, token_ids = "", []
        while engine.has_unfinished():
            for out in engine.step():
                text, token_ids = text + out.outputs[0].text, token_ids + out.outputs[0].token_ids
                if out.finished:
                    outs[windows] = (text, token_ids, out.outputs[0].finish_reason)
    assert outs[False] == outs[True]
    assert outs[True][2] == "stop" and stop not in outs[True][0]
    assert engine.kv_cache.num_free_pages == engine.kv_cache.num_usable_pages


@pytest.mark.parametrize("flag, compiled", [("auto", False), ("on", True), ("off", False)])
def test_the_greedy_variant_flag_reaches_the_runner(flag, compiled):
    """`--greedy-variant` (the CLI's and the servers' engine flags); auto is on GPUs only."""
    from jaxinfer import cli
    from jaxinfer.cli.args import make_llm

    args = cli.build_parser().parse_args(
        [
            "serve",
            "--model",
            str(FIXTURES / "hf" / "llama3"),
            "--dtype",
            "float32",
            "--num-pages",
            "8",
            "--max-model-len",
            "64",
            "--token-buckets",
            "8,32",
            "--max-num-batched-tokens",
            "32",
            "--greedy-variant",
            flag,
            "--dispatch-thread",
            flag,
        ]
    )
    runner = make_llm(args, warm_up=False).engine.worker
    assert runner.step.greedy_buckets == ((8, 32) if compiled else ())
    assert runner.step.launcher.enabled is compiled


def test_llm_takes_engine_options_as_keywords():
    from jaxinfer import LLM

    model, small = (
        str(FIXTURES / "hf" / "llama3"),
        dict(num_pages=8, max_model_len=64, warm_up=False, token_buckets=(8, 32), max_num_batched_tokens=32),
    )
    runner = LLM(model, "float32", greedy_variant=True, dispatch_thread=True, **small).engine.worker
    assert runner.step.greedy_buckets == (8, 32) and runner.step.launcher.enabled
    with pytest.raises(TypeError, match="no_such_option"):
        LLM(model, "float32", no_such_option=1, **small)


def test_llm_serves_a_loaded_model_as_it_is():
    """One load, several engines: LLM takes a LoadedModel and refuses what only a load decides."""
    from jaxinfer import LLM

    model = load_model(FIXTURES / "hf" / "llama3", dtype="float32")
    small = dict(num_pages=8, max_model_len=64, warm_up=False, token_buckets=(8,), max_num_batched_tokens=8)
    llm = LLM(model, **small)
    assert llm.engine.model is model
    for bad in (dict(dtype="bfloat16"), dict(quantization="int8"), dict(mesh="tensor=1")):
        with pytest.raises(ValueError, match="a loaded model is served on one device as it was loaded"):
            LLM(model, **bad, **small)
