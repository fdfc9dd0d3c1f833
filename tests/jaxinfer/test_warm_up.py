"""The warm-up compiles the step's variants on a pool of threads, and running each variant after
them compiles nothing again (jaxinfer/worker/warm_up.py)."""

import threading

import jax
import pytest
from testpaths import FIXTURES

from jaxinfer import SamplingParams
from jaxinfer.config import EngineConfig
from jaxinfer.engine import Engine
from jaxinfer.loader import load_model
from jaxinfer.worker import compiled_step as runner_module
from jaxinfer.worker import warm_up

# A backend compile, or an executable read from JAX's persistent cache instead (where one is on).
COMPILE_EVENTS = ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_retrieval_time_sec")


@pytest.fixture(scope="module")
def model():
    return load_model(FIXTURES / "hf" / "llama3", dtype="float32")


def test_the_variants_compile_side_by_side_and_their_first_runs_compile_nothing(model, monkeypatch):
    engine = Engine(
        model,
        EngineConfig(
            max_model_len=128,
            num_pages=16,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            token_buckets=(4, 32),
            num_decode_steps=4,
            greedy_variant=True,
            compilation_cache_dir=None,
        ),
        warm_up=False,
    )
    runner = engine.worker
    variants = warm_up.step_variants(runner.step)
    # Two buckets with and without a penalty history, the window and its greedy twin for bucket 4.
    assert [(i.token_ids.shape[-1], steps, greedy) for i, steps, greedy in variants] == [
        (4, 1, False),
        (4, 1, False),
        (32, 1, False),
        (32, 1, False),
        (4, 4, False),
        (4, 4, True),
    ]
    assert runner.step.split_buckets == ()  # off on the CPU: nothing is compiled after the loop below

    phase, events = ["before"], []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: (
            events.append((phase[0], threading.current_thread().name)) if name in COMPILE_EVENTS else None
        )
    )
    lowered = []

    def compile_all(programs, platform, threads=None):
        lowered.extend(programs)
        phase[0] = "compile_all"
        try:
            return warm_up.compile_all(programs, platform, threads)
        finally:
            phase[0] = "run"

    monkeypatch.setattr(runner_module, "compile_all", compile_all)
    monkeypatch.delenv(warm_up.THREADS_VAR, raising=False)
    monkeypatch.setattr(warm_up.os, "cpu_count", lambda: 4)
    runner.warm_up()

    assert len(lowered) == len(variants)
    compiled = [thread for when, thread in events if when == "compile_all"]
    assert len(compiled) >= len(variants), events
    assert all(thread.startswith("compile") for thread in compiled), compiled
    assert len(set(compiled)) > 1, compiled  # several threads
    assert [e for e in events if e[0] == "run"] == []  # each variant ran on what was compiled
    after = runner.num_compiled()
    engine.add_request([1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert runner.num_compiled() == after and [e for e in events if e[0] == "run"] == []


def test_compile_threads_follow_the_cores(monkeypatch):
    monkeypatch.delenv(warm_up.THREADS_VAR, raising=False)
    monkeypatch.setattr(warm_up.os, "cpu_count", lambda: 2)
    assert warm_up.compile_threads(10) == 2 and warm_up.compile_threads(1) == 1
    monkeypatch.setattr(warm_up.os, "cpu_count", lambda: 224)
    assert warm_up.compile_threads(40) == warm_up.MAX_COMPILE_THREADS
    monkeypatch.setattr(warm_up.os, "cpu_count", lambda: None)
    assert warm_up.compile_threads(5) == 1
    monkeypatch.setattr(warm_up.os, "cpu_count", lambda: 16)
    assert warm_up.compile_threads(10, "tpu") == 10 and warm_up.compile_threads(10, "gpu") == 1


def test_the_thread_count_can_be_set(monkeypatch):
    monkeypatch.setattr(warm_up.os, "cpu_count", lambda: 64)
    monkeypatch.setenv(warm_up.THREADS_VAR, "1")
    assert warm_up.compile_threads(40) == 1
    monkeypatch.setenv(warm_up.THREADS_VAR, "32")
    assert warm_up.compile_threads(40) == 32 and warm_up.compile_threads(3) == 3
    assert warm_up.compile_threads(40, "gpu") == 32  # the setting holds on GPUs too
    for bad in ("0", "-2", "four", "1.5"):
        monkeypatch.setenv(warm_up.THREADS_VAR, bad)
        with pytest.raises(ValueError, match=f"JAXINFER_COMPILE_THREADS='{bad}'"):
            warm_up.compile_threads(4)


def test_a_failed_compile_is_raised():
    class Broken:
        def compile(self):
            raise RuntimeError("no memory for this variant")

    class Fine:
        def compile(self):
            return "compiled"

    with pytest.raises(RuntimeError, match="no memory for this variant"):
        warm_up.compile_all([Fine(), Broken(), Fine()])
    assert warm_up.compile_all([Fine()]) == ["compiled"]


def test_the_cli_help_names_the_setting():
    from jaxinfer.cli import build_parser

    assert f"{warm_up.THREADS_VAR}=N" in " ".join(build_parser().format_help().split())


def test_generate_compiles_only_the_variants_its_prompt_uses(monkeypatch, capsys):
    """`jaxinfer generate` compiles nothing ahead: a short prompt's steps compile the buckets it
    meets (counted in the step's jits), not all of them; its answer is the warmed engine's."""
    from jaxinfer.cli import generate as generate_module
    from jaxinfer.cli import main
    from jaxinfer.llm import LLM

    built = []
    make_llm = generate_module.make_llm
    monkeypatch.setattr(generate_module, "make_llm", lambda *a, **kw: built.append(make_llm(*a, **kw)) or built[-1])
    options = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(4, 8, 32))
    options |= dict(num_pages=16, num_decode_steps=4, penalties=False)
    flags = "--max-model-len 128 --max-num-seqs 4 --max-num-batched-tokens 32 --token-buckets 4,8,32 "
    flags += "--num-pages 16 --num-decode-steps 4 --no-penalties --max-tokens 6 --temperature 0 --ignore-eos"
    model = str(FIXTURES / "hf" / "llama3_chat")
    assert main(["generate", "--model", model, "--dtype", "float32", *flags.split(), "Hi there"]) == 0
    step = built[0].engine.worker.step
    compiled = step._step._cache_size() + step._window._cache_size()
    assert 0 < compiled < len(warm_up.step_variants(step)), compiled
    warmed = LLM(model, dtype="float32", **options)
    want = warmed.generate("Hi there", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert capsys.readouterr().out == want.outputs[0].text + "\n"
