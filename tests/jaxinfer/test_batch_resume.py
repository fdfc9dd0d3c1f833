"""`jaxinfer batch` is exactly once across kills: SIGKILL at random points, rerun, and the output
holds every input line once, in input order, identical to an uninterrupted run (greedy)."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from testpaths import FIXTURES

from jaxinfer.journal import Journal, line_key

MODEL = str(FIXTURES / "hf" / "llama3")  # no tokenizer: prompt_token_ids lines


def write_input(path, n, broken=(5,)):
    lines = []
    for i in range(1, n + 1):
        if i in broken:
            lines.append("{not json")
        else:
            ids = [(i * 7 + k * 13) % 250 + 1 for k in range(3 + i % 5)]
            lines.append(json.dumps({"id": f"r{i}", "prompt_token_ids": ids, "max_tokens": 6 + i % 4}))
    path.write_text("\n".join(lines) + "\n")
    return lines


def batch_cmd(inp, out, cache):
    return [
        sys.executable,
        "-m",
        "jaxinfer.cli",
        "batch",
        "--input",
        str(inp),
        "--output",
        str(out),
        "--model",
        MODEL,
        "--temperature",
        "0",
        "--ignore-eos",
        "--max-num-seqs",
        "4",
        "--max-in-flight",
        "3",
        "--max-num-batched-tokens",
        "32",
        "--token-buckets",
        "4,32",
        "--max-model-len",
        "64",
        "--num-pages",
        "40",
        "--page-size",
        "8",
    ]


def env(cache):
    return {**os.environ, "JAX_PLATFORMS": "cpu"}


def journal_lines(path):
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def run_killed_at(inp, out, cache, threshold, timeout=180):
    """Starts the job and SIGKILLs it once its journal holds `threshold` results (0: at start-up)."""
    journal = out.with_name(out.name + ".journal")
    proc = subprocess.Popen(
        batch_cmd(inp, out, cache), env=env(cache), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL
    )
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if journal_lines(journal) >= threshold:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait()
    return proc.returncode


@pytest.mark.slow
def test_sigkill_and_resume_is_exactly_once(tmp_path):
    cache = tmp_path / "xla"
    inp = tmp_path / "in.jsonl"
    write_input(inp, 14)
    want_out = tmp_path / "want.jsonl"
    subprocess.run(batch_cmd(inp, want_out, cache), env=env(cache), check=True, capture_output=True)
    want = want_out.read_text().splitlines()
    assert len(want) == 14 and not want_out.with_name("want.jsonl.journal").exists()

    out = tmp_path / "out.jsonl"
    kills = 0
    for threshold in [0] + sorted(random.Random(7).sample(range(1, 13), 3)):
        if run_killed_at(inp, out, cache, threshold) == -signal.SIGKILL:
            kills += 1
    assert kills >= 2, "the job finished before it could be killed: thresholds too high"
    done = subprocess.run(batch_cmd(inp, out, cache), env=env(cache), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "from an earlier run" in done.stderr and "requests/s" in done.stderr
    got = out.read_text().splitlines()
    assert got == want  # every line once, in input order, the same results
    records = [json.loads(line) for line in got]
    assert [r.get("id") for r in records if "outputs" in r] == [f"r{i}" for i in range(1, 15) if i != 5]
    assert records[4]["error"].startswith("line 5: not valid JSON")
    assert not out.with_name("out.jsonl.journal").exists()


def test_journal_drops_a_torn_last_line_and_rejects_garbage(tmp_path):
    path = tmp_path / "o.journal"
    j = Journal(path)
    j.append(1, line_key("a"), {"id": "a"})
    j.append(3, line_key("c"), {"id": "c"})
    j.close()
    with open(path, "ab") as f:
        f.write(b'{"line": 4, "sha": "x", "rec')  # killed mid-write
    j = Journal(path)
    assert len(j) == 2 and j.done(1, line_key("a")) and j.record(3) == {"id": "c"}
    assert not j.done(1, line_key("a changed")) and not j.done(2, line_key("b"))
    j.append(4, line_key("d"), {"id": "d"})  # appended after the truncation: a whole line
    j.close()
    assert [json.loads(x)["line"] for x in path.read_text().splitlines()] == [1, 3, 4]
    path.write_text("not a journal\n")
    with pytest.raises(ValueError, match="o.journal"):
        Journal(path)


def test_changed_input_lines_are_served_again(tmp_path, monkeypatch):
    """In process: a journal entry whose input text changed is not reused."""
    import io

    from jaxinfer.cli.batch import run_batch
    from jaxinfer.llm import LLM
    from jaxinfer.sampling import SamplingParams

    llm = LLM(
        MODEL,
        "float32",
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        token_buckets=(4, 32),
        num_pages=40,
        page_size=8,
    )
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = [
        json.dumps({"id": "a", "prompt_token_ids": [1, 2, 3]}),
        json.dumps({"id": "b", "prompt_token_ids": [4, 5, 6]}),
    ]
    journal = Journal(tmp_path / "o.journal")
    out = io.StringIO()
    stats = run_batch(llm, first, out, params, journal=journal)
    assert (stats.served, stats.resumed) == (2, 0)
    second = [first[0], json.dumps({"id": "b2", "prompt_token_ids": [7, 8, 9]})]
    out2 = io.StringIO()
    stats = run_batch(llm, second, out2, params, journal=journal)
    assert (stats.served, stats.resumed) == (2, 1)
    a1, b1 = (json.loads(x) for x in out.getvalue().splitlines())
    a2, b2 = (json.loads(x) for x in out2.getvalue().splitlines())
    assert a2 == a1 and b2["id"] == "b2" and b2["outputs"] != b1["outputs"]
    journal.close()
