"""Two processes on loopback (jax.distributed over 127.0.0.1) run one engine together: process 0
schedules and broadcasts each step, and its tokens equal the single-process run's (which the
llama3 generate golden records; tests/jaxinfer/test_engine.py holds one device to it), the KV
host tier included (each process offloads and loads its own shards of the pages)."""

import numpy as np
import pytest
from testpaths import FIXTURES

from jaxinfer.convert import convert


@pytest.mark.parametrize(
    "mesh,devices", [("tensor=2", 1), ("data=2,tensor=2", 2)], ids=["tensor2-across-hosts", "data2xtensor2"]
)
def test_two_processes_match_one(processes, port, mesh, devices):
    # With the KV host tier (0.01 GiB): each process keeps its own shards of the pages.
    args = [["multihost", str(i), str(port), mesh, "", "0.01"] for i in range(2)]
    leader, follower = processes(args, devices=devices)
    assert (leader["process"], follower["process"]) == (0, 1)
    assert leader["processes"] == 2 and leader["devices"] == 2 * devices
    assert leader["local_devices"] == devices
    assert leader["outputs"] == leader["expected"]
    assert follower["outputs"] == []  # followers run the steps; process 0 returns the results
    golden = np.load(FIXTURES / "hf" / "llama3" / "golden.npz")
    ids, logits = golden["input_ids"], golden["logits"].astype(np.float64)
    expected = logits[np.arange(63), ids[1:]] - np.log(np.exp(logits[:63]).sum(-1))  # HF's log_softmax
    np.testing.assert_allclose(leader["prompt_logprobs"], expected, atol=1e-4)
    assert follower["prompt_logprobs"] == []
    assert leader["host_hits"] > 0 and leader["pools_empty"]  # the second call's prompts: from host pages


def test_two_processes_restore_an_orbax_checkpoint(processes, port, tmp_path):
    """Each process restores its own shards of a converted checkpoint; the outputs are the
    single-process run's."""
    convert(FIXTURES / "hf" / "llama3", tmp_path / "ckpt", dtype="float32", progress=False)
    leader, follower = processes(
        [["multihost", str(i), str(port), "tensor=2", str(tmp_path / "ckpt")] for i in range(2)], devices=1
    )
    assert leader["outputs"] == leader["expected"]
    assert follower["outputs"] == []
