"""The executable store (jaxinfer/worker/executables.py, programs.py): a warm start reads every step
variant and traces, lowers and compiles none of them; an entry made under another jax version,
code version or config is never used; a truncated or corrupt entry is refused with a warning and
compiled again; `jaxinfer warm-up` fills it."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import jax
import pytest
from engine_runs import run_requests
from testpaths import FIXTURES, TESTS

from jaxinfer import SamplingParams
from jaxinfer.config import EngineConfig
from jaxinfer.engine import Engine
from jaxinfer.loader import load_model
from jaxinfer.worker import executables

REPO = TESTS.parent
MODEL = FIXTURES / "hf" / "llama3"
OPTIONS = dict(
    max_model_len=128,
    num_pages=16,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    token_buckets=(4, 32),
    num_decode_steps=4,
    penalties=False,
    compilation_cache_dir=None,
)
STEP_PROGRAMS = ("step", "decode_window")  # the step's jitted functions, as JAX names them in events
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9] * 5]
GREEDY = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL, dtype="float32")


def tokens(engine: Engine) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in run_requests(engine, [(p, GREEDY) for p in PROMPTS])]


def build(model, store, **options) -> Engine:
    return Engine(model, EngineConfig(**{**OPTIONS, "executable_cache_dir": str(store), **options}))


def programs(engine: Engine):
    return engine.worker.step.programs


# A process that builds the engine (every variant ready before it returns), runs the prompts and
# prints, as JSON, the tokens and every trace, lowering and backend compile of the step's programs.
WARM_START = textwrap.dedent(
    """
    import json, sys
    import jax
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, fun_name=None, **kw: events.append([name.rsplit("/", 1)[-1], str(fun_name)])
        if name.startswith("/jax/core/compile/") else None
    )
    from jaxinfer import LLM, SamplingParams
    options = json.loads(sys.argv[1])
    llm = LLM(sys.argv[2], dtype="float32", **options)
    outs = llm.generate(json.loads(sys.argv[3]), SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
                        use_tqdm=False)
    programs = llm.engine.worker.step.programs
    print(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs], "events": events,
                      "sources": [r.source for r in programs.records]}))
    """
)


def step_events(events: list[list[str]]) -> list[list[str]]:
    """The events of the step's programs (JAX names them "step", "jit(step)" or "jit_step")."""

    def program(name: str) -> str:
        return name[4:-1] if name.startswith("jit(") and name.endswith(")") else name.removeprefix("jit_")

    return [e for e in events if program(e[1]) in STEP_PROGRAMS]


def warm_start(store, devices: int = 1, **options) -> dict:
    """WARM_START in a process of `devices` CPU devices."""
    env = {**os.environ, "JAXINFER_EXECUTABLE_CACHE_DIR": "none"}
    if devices > 1:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    args = json.dumps({**OPTIONS, "executable_cache_dir": str(store), **options})
    out = subprocess.run(
        [sys.executable, "-c", WARM_START, args, str(MODEL), json.dumps(PROMPTS)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_warm_start_reads_every_variant_and_traces_lowers_compiles_none(tmp_path, model):
    baseline = tokens(build(model, "none"))  # the jit, no store
    cold = warm_start(tmp_path)
    assert set(cold["sources"]) == {"compiled"} and len(cold["sources"]) == 3  # 2 buckets and the window
    assert {e[0] for e in step_events(cold["events"])} == {  # it did trace, lower and compile them
        "jaxpr_trace_duration",
        "jaxpr_to_mlir_module_duration",
        "backend_compile_duration",
    }
    warm = warm_start(tmp_path)
    assert warm["sources"] == ["store"] * 3
    assert step_events(warm["events"]) == []
    assert warm["tokens"] == cold["tokens"] == baseline
    print("other programs traced in a warm start (loading, page table):", sorted({e[1] for e in warm["events"]}))


@pytest.mark.parametrize("mesh", [None, "tensor=2"])
def test_a_warm_start_on_some_of_a_processs_devices(tmp_path, mesh):
    """Each executable is loaded onto the devices it was compiled for (one of four, two of four),
    not every device of the process (which fails a check that ends the process)."""
    cold = warm_start(tmp_path, devices=4, mesh=mesh)
    warm = warm_start(tmp_path, devices=4, mesh=mesh)
    assert set(cold["sources"]) == {"compiled"} and warm["sources"] == ["store"] * len(cold["sources"])
    assert warm["tokens"] == cold["tokens"]


def test_an_entry_from_another_environment_code_or_config_is_not_used(tmp_path, model, monkeypatch):
    first = build(model, tmp_path)
    assert [r.source for r in programs(first).records] == ["compiled"] * 3
    expected = tokens(first)
    entries = sorted(tmp_path.glob("*.jxe"))
    assert len(entries) == 3
    again = build(model, tmp_path)
    assert [r.source for r in programs(again).records] == ["store"] * 3 and programs(again).store.loaded == 3
    compiled = again.worker.num_compiled()
    assert tokens(again) == expected and again.worker.num_compiled() == compiled  # nothing after warm-up

    changes = {
        "jax version": lambda: monkeypatch.setattr(jax, "__version__", "0.0.1"),
        "code version": lambda: monkeypatch.setattr(executables, "code_version", lambda: "f" * 64),
        "XLA flags": lambda: monkeypatch.setenv(
            "XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_dump_to=/dev/null"
        ),
    }
    for what, change in changes.items():
        with monkeypatch.context() as m:
            monkeypatch = m  # noqa: PLW2901  # the change is undone when the context ends
            change()
            other = build(model, tmp_path)
            assert programs(other).store.loaded == 0, what
            assert [r.source for r in programs(other).records] == ["compiled"] * 3, what
    # A config that changes nothing a program sees still keys apart: the whole config is in the key.
    other = build(model, tmp_path, max_num_seqs=3)
    assert programs(other).store.loaded == 0 and tokens(other) == expected


def test_a_truncated_or_corrupt_entry_is_recompiled_with_a_warning(tmp_path, model, caplog):
    expected = tokens(build(model, tmp_path))
    entries = sorted(tmp_path.glob("*.jxe"), key=lambda p: p.stat().st_size)
    truncated, corrupt, renamed = entries
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    data = bytearray(corrupt.read_bytes())
    data[-100] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    renamed.write_bytes(truncated.read_bytes())  # another program's entry under this key
    with caplog.at_level(logging.WARNING, logger=executables.__name__):
        engine = build(model, tmp_path)
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 3, refused
    assert any("truncated" in m for m in refused) and any("checksum" in m for m in refused)
    assert programs(engine).store.refused == 3 and [r.source for r in programs(engine).records] == ["compiled"] * 3
    assert tokens(engine) == expected
    # Compiled again and stored again: the next start reads them all.
    assert [r.source for r in programs(build(model, tmp_path)).records] == ["store"] * 3


def test_variants_compiled_when_first_needed_are_stored_too(tmp_path, model):
    lazy = Engine(model, EngineConfig(**{**OPTIONS, "executable_cache_dir": str(tmp_path)}), warm_up=False)
    assert programs(lazy).num_programs() == 0
    expected = tokens(lazy)
    used = programs(lazy).num_programs()
    assert 1 <= used <= 3 and programs(lazy).store.stored == used
    again = Engine(model, EngineConfig(**{**OPTIONS, "executable_cache_dir": str(tmp_path)}), warm_up=False)
    assert tokens(again) == expected and programs(again).store.loaded == used


def test_an_unwritable_store_costs_only_the_entries(tmp_path, model, caplog):
    store = tmp_path / "store"
    store.write_text("a file where the directory should be")
    with caplog.at_level(logging.WARNING, logger=executables.__name__):
        engine = build(model, store)
    assert programs(engine).store.stored == 0
    assert any("not stored" in r.getMessage() for r in caplog.records)
    assert tokens(engine) == tokens(build(model, "none"))


def test_the_store_is_off_for_none_and_with_several_processes(model, monkeypatch):
    assert programs(build(model, "none")).store is None
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    from jaxinfer.worker.programs import executable_store

    assert executable_store(EngineConfig(executable_cache_dir="/tmp/x"), model.config, None, jax.devices()[0]) is None


def test_the_warm_up_command_fills_the_store(tmp_path):
    flags = ["--model", str(MODEL), "--dtype", "float32", "--max-model-len", "128", "--num-pages", "16"]
    flags += ["--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--token-buckets", "4,32", "--no-penalties"]
    flags += ["--num-decode-steps", "4", "--compilation-cache-dir", "none", "--executable-cache-dir", str(tmp_path)]

    def run() -> dict:
        out = subprocess.run(
            [sys.executable, "-m", "jaxinfer.cli", "warm-up", *flags, "--output-format", "json"],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout)

    first = run()
    assert first["compiled"] == 3 and first["read_from_store"] == 0 and first["store"] == str(tmp_path)
    assert [v["variant"] for v in first["variants"]] == ["step tokens=4", "step tokens=32", "window tokens=4"]
    second = run()
    assert second["compiled"] == 0 and second["read_from_store"] == 3
    # `serve --warm-up-only` builds serve's engine from the same flags: the same keys, then exits.
    out = subprocess.run(
        [sys.executable, "-m", "jaxinfer.cli", "serve", *flags, "--port", "0", "--warm-up-only"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "3 step variants (0 compiled, 3 read)" in out.stdout and "listening" not in out.stdout
    # `jaxinfer info` (which compiles nothing) says how many a start with these flags would read.
    out = subprocess.run(
        [sys.executable, "-m", "jaxinfer.cli", "info", *flags], capture_output=True, text=True, cwd=REPO, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    startup = json.loads(out.stdout)["startup"]
    assert startup == {
        "executable_store": str(tmp_path),
        "stored_variants": 3,
        "prepared_weights": str(tmp_path / "weights"),
        "prepared_weights_kept": False,  # an HF directory: its load only reads
        "compilation_cache": None,
        "compile_in_background": False,
    }


def test_variants_compiled_in_the_background_are_stored_under_the_same_keys(tmp_path, model):
    """Traced against abstract copies of the parameters and caches, they sign as the real ones:
    an engine that compiles everything first reads every one of them."""
    engine = build(model, tmp_path, compile_in_background=True)
    assert engine.worker.step.background.join(300) and engine.worker.step.complete
    stored = programs(engine).store.stored
    assert stored == len(programs(engine).records) == 3
    strict = build(model, tmp_path)
    assert programs(strict).store.loaded == 3 and tokens(strict) == tokens(engine)
