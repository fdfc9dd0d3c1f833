"""jaxinfer on a local Ray cluster (started by the test, tests/support/ray_support.py), with the tiny
Llama fixture and its chat template:

- Ray Data (`jaxinfer.integrations.ray.build_processor`), 2 replicas over 60 rows of prompts and
  chats: greedy outputs identical to `jaxinfer batch` on the same lines, every id once, though a
  replica actor is SIGKILLed mid-job (Ray restarts it and runs its batches again); a bad row costs
  its own output only.
- `jaxinfer batch --ray` over a directory of shards, SIGKILLed mid-run and run again: every id once,
  in input order, identical to `jaxinfer batch` on the joined file; the rerun serves only the lines
  the journal lacked (counted from its summary).
- Rows under LoRA adapters (a "lora" column, adapters loaded from their paths): PEFT's tokens.
- A bad config fails fast, naming what is wrong: an unknown engine option, a resource the cluster
  lacks (the Python API and the CLI)."""

import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from ray_support import replica_pids, running_cluster
from testpaths import FIXTURES, TESTS, TINY_SERVE_ARGS

from jaxinfer.cli.batch import run_batch
from jaxinfer.journal import Journal
from jaxinfer.llm import LLM
from jaxinfer.sampling.params import SamplingParams

pytest.importorskip("ray.data")
from jaxinfer.integrations.ray import JaxinferProcessorConfig, build_processor  # noqa: E402

MODEL = str(FIXTURES / "hf" / "llama3_chat")
ENGINE = {
    "dtype": "float32",
    "max_model_len": 256,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 32,
    "token_buckets": (8, 32),
    "num_pages": 48,
    "penalties": False,
}
ARGS = [MODEL if arg.endswith("llama3") else arg for arg in TINY_SERVE_ARGS]  # the same engine as flags
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
N = 150  # lines of the CLI job (the Ray Data job takes the first 60)


def requests(n: int) -> list[dict]:
    """Prompts and chats of assorted lengths, as `jaxinfer batch` lines take them."""
    out = []
    for i in range(n):
        if i % 3 == 0:
            out.append({"id": f"c{i}", "messages": [{"role": "user", "content": f"Tell me about {i} cats"}]})
        else:
            out.append({"id": f"p{i}", "prompt": "Once upon a time " + "there was " * (i % 5) + str(i)})
        out[-1]["max_tokens"] = 12 + i % 9
    return out


@pytest.fixture(scope="module")
def cluster():
    yield from running_cluster()


@pytest.fixture(scope="module")
def plain():
    """`jaxinfer batch`'s records of requests(N), from one engine in this process."""
    llm = LLM(MODEL, **ENGINE)
    lines = [json.dumps(r) for r in requests(N)]
    out = io.StringIO()
    run_batch(llm, lines, out, GREEDY)
    return {r["id"]: r for r in map(json.loads, out.getvalue().splitlines())}


def test_ray_data_matches_batch_with_a_replica_killed_mid_job(cluster, plain):
    import ray
    import ray.data

    ray.init(address=cluster.address, log_to_driver=False)
    rows = requests(60) + [{"id": "bad", "prompt": "x", "max_tokens": -1}]
    config = JaxinferProcessorConfig(
        MODEL, ENGINE, concurrency=2, batch_size=4, max_concurrent_batches=2, sampling_defaults={"temperature": 0}
    )
    nest = lambda row: {**row, "sampling_params": {"max_tokens": row.pop("max_tokens")}}  # noqa: E731
    processor = build_processor(config, preprocess=nest, postprocess=lambda row: {**row, "seen": True})
    dataset = processor(ray.data.from_items(rows, override_num_blocks=12))
    got, killed = [], None
    for row in dataset.iter_rows():
        got.append(row)
        if killed is None and len(got) >= 4:
            pids = replica_pids(r"MapBatches\(RowReplica\)")
            assert len(pids) == 2, pids
            killed = pids[0]
            os.kill(killed, signal.SIGKILL)
    assert killed is not None and len(got) == len(rows)
    by_id = {row["id"]: row for row in got}
    assert len(by_id) == len(rows)  # every id once
    bad = by_id.pop("bad")
    assert bad["error"].startswith("row bad: SamplingParams.max_tokens=-1: must be") and bad["generated_text"] is None
    for rid, row in by_id.items():
        want = plain[rid]["outputs"][0]
        assert (row["generated_text"], row["generated_tokens"]) == (want["text"], want["token_ids"]), rid
        assert row["finish_reason"] == want["finish_reason"] and row["error"] is None and row["seen"]
        assert row["num_input_tokens"] == plain[rid]["usage"]["prompt_tokens"] and row["time_taken_llm"] > 0
    assert killed not in replica_pids(r"MapBatches\(RowReplica\)")  # it really died
    ray.shutdown()


def batch_ray(inp, out, address, *extra) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jaxinfer.cli", "batch", "--input", str(inp), "--output", str(out)]
    cmd += [*ARGS, "--temperature", "0", "--max-tokens", "16", "--ray", address, "--replicas", "2", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def journal_lines(path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_batch_ray_killed_and_rerun_writes_every_id_once(cluster, plain, tmp_path):
    lines = [json.dumps(r) for r in requests(N)]
    shards = tmp_path / "in"
    shards.mkdir()
    (shards / "part-0.jsonl").write_text("\n".join(lines[:25]) + "\n\n")  # a blank line: skipped, counted
    (shards / "part-1.jsonl").write_text("{broken\n" + "\n".join(lines[25:]) + "\n")
    (shards / "notes.txt").write_text("not a shard")
    out = tmp_path / "out.jsonl"
    journal = tmp_path / "out.jsonl.journal"
    first = batch_ray(shards, out, cluster.address)
    deadline = time.monotonic() + 240
    while journal_lines(journal) < 1 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert first.poll() is None, first.communicate()[1][-3000:]
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    kept = len(Journal(journal))  # whole entries only
    assert 1 <= kept < N + 1 and not out.exists()
    second = batch_ray(shards, out, cluster.address)
    _, err = second.communicate(timeout=300)
    assert second.returncode == 0, err[-3000:]
    assert f"{N} served, 1 failed ({kept} from an earlier run, {N + 1 - kept} run now)" in err, err[-2000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == [r["id"] for r in requests(25)] + [None] + [r["id"] for r in requests(N)[25:]]
    assert records[25]["error"].startswith("line 27: not valid JSON")  # numbered as the joined file
    for r in (r for r in records if r["id"] is not None):  # the same outputs (cache hits may differ)
        assert (
            r["outputs"] == plain[r["id"]]["outputs"]
            and r["usage"]["prompt_tokens"] == plain[r["id"]]["usage"]["prompt_tokens"]
        )
    assert not journal.exists()


def test_bad_configs_fail_fast_naming_the_problem(cluster, tmp_path):
    import ray

    with pytest.raises(ValueError, match="engine_kwargs: EngineConfig: unknown option 'max_num_seq'"):
        JaxinferProcessorConfig(MODEL, {"max_num_seq": 4})
    with pytest.raises(ValueError, match=r"concurrency must be a positive count or \(min, max\), got \(3, 1\)"):
        JaxinferProcessorConfig(MODEL, ENGINE, concurrency=(3, 1))
    ray.init(address=cluster.address, log_to_driver=False)
    config = JaxinferProcessorConfig(MODEL, ENGINE, concurrency=2, resources={"TPU": 4})
    with pytest.raises(ValueError, match=r"2 replica\(s\) x TPU=4 needs 8, but the Ray cluster has 0 TPU"):
        build_processor(config)(ray.data.from_items([{"prompt": "hi"}]))
    ray.shutdown()
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hi"}\n')
    start = time.monotonic()
    proc = batch_ray(inp, tmp_path / "out.jsonl", cluster.address, "--ray-resources", '{"CPU": 1, "GPU": 1}')
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "x GPU=1 needs 2, but the Ray cluster has 0 GPU" in err, err[-2000:]
    assert time.monotonic() - start < 60  # refused before any actor waits for a GPU


def test_rows_under_lora_adapters_match_peft(cluster):
    """A row's "lora" column picks its adapter (by path, loaded on demand): PEFT's greedy tokens."""
    import ray
    import ray.data

    mixed = json.loads((FIXTURES / "lora" / "mixed.json").read_text())
    rows = [
        {
            "id": f"{name}/{i}",
            "prompt_token_ids": prompt,
            "lora": None if path is None else {"name": name, "path": str(TESTS.parent / path)},
        }
        for name, path in mixed["adapters"].items()
        for i, prompt in enumerate(mixed["prompts"])
    ]
    engine = {**ENGINE, "enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
    config = JaxinferProcessorConfig(
        str(FIXTURES / "hf" / "llama3"),
        engine,
        batch_size=4,
        sampling_defaults={"temperature": 0, "max_tokens": mixed["max_new_tokens"], "ignore_eos": True},
    )
    ray.init(address=cluster.address, log_to_driver=False)
    got = {row["id"]: row for row in build_processor(config)(ray.data.from_items(rows)).iter_rows()}
    ray.shutdown()
    for name in mixed["adapters"]:
        for i, want in enumerate(mixed["outputs"][name]):
            assert got[f"{name}/{i}"]["generated_tokens"] == want, (name, i, got[f"{name}/{i}"]["error"])


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"--input": "-"}, "--input -: --ray reads files (the replicas read their lines), not stdin"),
        ({"--output": "-"}, "--output: --ray writes a file (its journal makes the job resumable), not stdout"),
        ({"--input": "/no/such"}, "--input /no/such: does not exist"),
        ({"--input": "EMPTY"}, "a directory with no *.jsonl files"),
        ({"--ray-resources": "[4]"}, "--ray-resources [4]: not a JSON object"),
        ({"--max-num-seqs": "0"}, "engine_kwargs: EngineConfig.max_num_seqs must be a positive integer, got 0"),
    ],
)
def test_the_cli_refuses_what_cannot_work_before_ray_starts(tmp_path, capsys, change, error):
    import ray

    from jaxinfer.cli import main

    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "empty").mkdir()
    flags = {"--input": str(tmp_path / "in.jsonl"), "--output": str(tmp_path / "out.jsonl"), **change}
    if flags["--input"] == "EMPTY":
        flags["--input"] = str(tmp_path / "empty")
    argv = ["batch", *ARGS, *(x for kv in flags.items() for x in kv), "--ray", "127.0.0.1:1"]
    assert main(argv) == 2
    assert error in capsys.readouterr().err
    assert not ray.is_initialized()  # refused before connecting to anything
