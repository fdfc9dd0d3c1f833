"""Two processes on loopback (jax.distributed over 127.0.0.1) run one engine together: process 0
schedules and broadcasts each step, and its tokens equal the single-process run's (which the
llama3 generate golden records; tests/jaxinfer/test_engine.py holds one device to it). With the
heads split across the processes, each restores its own shards of an orbax checkpoint and keeps
its own shards of the KV host tier's pages; with pipeline stages each process holds one stage's
layers and the activation crosses between them once per stage boundary."""

import numpy as np
import pytest
from testpaths import FIXTURES

from jaxinfer.convert import convert


@pytest.mark.parametrize(
    "mesh,devices",
    [("tensor=2", 1), ("data=2,tensor=2", 2), ("stage=2", 1)],
    ids=["tensor2-across-hosts", "data2xtensor2", "stage2-one-stage-per-host"],
)
def test_two_processes_match_one(processes, port, mesh, devices, tmp_path):
    model, offload = "", "0"
    if mesh == "tensor=2":  # from an orbax checkpoint, with the KV host tier
        model, offload = str(tmp_path / "ckpt"), "0.01"
        convert(FIXTURES / "hf" / "llama3", model, dtype="float32", progress=False)
    args = [["multihost", str(i), str(port), mesh, model, offload] for i in range(2)]
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
    assert leader["pools_empty"]
    assert leader["in_flight"] == follower["in_flight"] == (2 if mesh == "stage=2" else 1)  # a batch on each stage
    if offload != "0":  # the second call's prompts came back from host pages, loaded by both processes
        assert leader["host_hits"] > 0
