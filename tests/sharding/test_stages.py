"""Pipeline stages (mesh axis `stage`): the plan, the stacked layouts, what a staged engine
refuses by name, and the engine on 8 forced CPU devices: SmolLM2 over 4 stages, over 2 stages
of 3-way tensor parallelism (and with its cache split along the sequence over 2 x tensor=3) gives
the single-device engine's greedy tokens, with every device
holding only its own stage's layers (compared shard by shard with the checkpoint's arrays) and
its stage's rows of every page; int8 weights, ngram and draft-model speculation and an int8 KV
cache over stages as on one device.
(Data replicas of stages, an odd layer count and a mixture of experts, stages with a split
cache: test_sharded_engine.py; one stage per process: test_multihost.py.)"""

import dataclasses

import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P
from testpaths import FIXTURES

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.worker.stages import stage_plan
from sharding import AXES
from sharding.stages import plan_stages, stacked_spec, stage_cache_spec

LLAMA = ModelConfig.from_hf_file(FIXTURES / "hf" / "llama3" / "config.json")


def mesh(stage=1, sequence=1, tensor=1, data=1):
    return AbstractMesh((data, stage, sequence, 1, tensor), AXES)


@pytest.mark.parametrize(
    "layers,stages,counts",
    [(30, 4, (8, 8, 7, 7)), (32, 4, (8, 8, 8, 8)), (5, 2, (3, 2)), (3, 3, (1, 1, 1)), (7, 1, (7,))],
)
def test_plan_is_contiguous_and_balanced(layers, stages, counts):
    plan = plan_stages(layers, stages)
    assert plan.counts == counts and plan.num_slots == max(counts)
    order = [plan.layer(s, j) for s in range(stages) for j in range(plan.num_slots)]
    assert [i for i in order if i is not None] == list(range(layers))  # every layer once, in order
    assert all(plan.stage_of(plan.layer(s, 0)) == s for s in range(stages))


def test_more_stages_than_layers_is_named():
    with pytest.raises(ValueError, match="stage=4 needs at least one layer per stage; the model has 2 layers"):
        plan_stages(2, 4)


def test_stacked_layouts():
    # A layer's split stays inside its stage's block of axis 0; caches split their page rows.
    assert stacked_spec(P(None, "tensor"), 2) == P("stage", "tensor")
    assert stacked_spec(P("tensor", None, None), 3) == P(("stage", "tensor"), None, None)
    assert stacked_spec(P(("expert", "tensor")), 2) == P(("stage", "expert", "tensor"), None)
    assert stage_cache_spec(P(None, None, "tensor", None)) == P(None, "stage", "tensor", None)
    assert stage_cache_spec(P("data", None, None, "tensor", None)) == P("data", None, "stage", "tensor", None)
    assert stage_cache_spec(P(None, "sequence", "tensor", None)) == P(None, ("stage", "sequence"), "tensor", None)
    assert stage_plan(LLAMA, EngineConfig(), mesh(stage=2, sequence=2)).counts == (1, 1)


def test_staged_engine_refuses_what_it_does_not_carry_by_name():
    assert stage_plan(LLAMA, EngineConfig(), mesh(tensor=2)) is None
    assert stage_plan(LLAMA, EngineConfig(), mesh(stage=2)).counts == (1, 1)
    cases = [
        (EngineConfig(enable_lora=True), mesh(stage=2), "LoRA adapters"),
    ]
    for engine, m, name in cases:
        with pytest.raises(ValueError, match=f"mesh stage=2: pipeline stages do not support {name}"):
            stage_plan(LLAMA, engine, m)
    gemma3 = ModelConfig.from_hf_file(FIXTURES / "hf" / "gemma3" / "config.json")
    with pytest.raises(ValueError, match="mix of sliding-window and full-attention layers"):
        stage_plan(gemma3, EngineConfig(), mesh(stage=2))
    moe = ModelConfig.from_hf_file(FIXTURES / "hf" / "qwen3_moe" / "config.json")  # layer 1 dense, 0 and 2 experts
    assert stage_plan(moe, EngineConfig(), mesh(stage=2)).counts == (2, 1)  # slots: (0, 2), (1, padding)
    with pytest.raises(ValueError, match=r"layers \[0, 1, 2\] share pipeline slot 0 but mix dense and expert"):
        stage_plan(moe, EngineConfig(), mesh(stage=3))
    with pytest.raises(ValueError, match="needs at least one layer per stage"):
        stage_plan(dataclasses.replace(LLAMA, num_layers=1), EngineConfig(), mesh(stage=2))


@pytest.mark.slow
def test_smollm2_stages_match_one_device_and_hold_only_their_layers(scenario):
    r = scenario("stages", "smollm2", "stage=4", "stage=2,tensor=3", "sequence=2,tensor=3", timeout=600)
    assert r["num_layers"] == 30
    split = r["sequence=2,tensor=3"]  # the cache split along the sequence: each device half of a page's rows
    assert split["mismatched"] == [] and split["recompiled"] == 0 and split["pools_empty"], split
    assert split["cache_rows"][0] == 2 * split["cache_rows"][1]
    layer = r["stage=4"]["single_layer_bytes"]
    for m, counts, tp in (("stage=4", [8, 8, 7, 7], 1), ("stage=2,tensor=3", [15, 15], 3)):
        got = r[m]
        assert got["mismatched"] == [] and got["recompiled"] == 0 and got["pools_empty"], got
        assert got["counts"] == counts and got["num_caches"] == max(counts)
        assert got["in_flight"] == len(counts)  # a batch on every stage (worker/pipelined.py)
        assert got["wrong"] == [], got["wrong"]  # each shard is its own stage's layer (or padding zeros)
        # One stage's slots on every device, split by tensor (norms whole): never another stage's layers.
        (per_device,) = got["layer_bytes_per_device"]
        assert max(counts) * layer / tp <= per_device < max(counts) * layer / tp * 1.01
        stages = len(counts)
        assert got["cache_rows"][0] == stages * got["cache_rows"][1]  # each stage holds its rows of a page


@pytest.mark.slow
def test_stages_with_int8_weights_and_speculation_match_one_device(scenario):
    r = scenario("stage_features", timeout=600)
    for feature in ("int8", "ngram", "draft", "int8-kv"):
        assert r[feature] == {"equal": True, "tokens": 30}, r


@pytest.mark.parametrize("mesh_spec", ["stage=2", "stage=4,tensor=2"])
def test_pipeline_ticks_keep_every_stage_busy_and_match_one_batch_at_a_time(scenario, mesh_spec):
    """sharding/pipeline.py: six batches through ticks, S in flight, give each batch's output (in
    order) and the caches that each batch through every stage in turn gives; every stage runs
    its own batch each tick (no conditional on the stage index)."""
    out = scenario("pipeline", mesh_spec)
    assert out["stages"] == int(mesh_spec.split(",")[0].split("=")[1])
    assert out["outputs"] == 0.0 and out["caches"] == 0.0 and out["written"]
    assert out["conditionals"] == 0 and out["conditionals_one_at_a_time"] == out["stages"]


def test_a_batch_in_flight_on_every_stage_matches_one_device(scenario):
    """worker/pipelined.py on stage=2,tensor=2: two virtual replicas take turns, every engine step
    one tick; the 16 HF prompts (a pool that forces preemption), two samples of one prompt
    (copy-on-write), prefix hits (some from the host tier), a repetition penalty and prompt logprobs give one device's
    tokens and logprobs, as
    the stages taking one batch at a time (--no-pipeline-batches) do; an abort while batches are in
    flight keeps what it had; nothing compiles after warm-up and every page comes back."""
    r = scenario("pipelined", "stage=2,tensor=2", timeout=600)
    single, piped, one = r["single"], r["piped"], r["one_at_a_time"]
    assert (single["in_flight"], piped["in_flight"], one["in_flight"]) == (1, 2, 1)
    assert piped["tokens"] == single["tokens"] and one["tokens"] == single["tokens"]
    assert len(piped["tokens"]) == 16 + 2 + 1 + 1 + 1  # the prompts, both samples, logprobs, penalty, late
    assert piped["prompt_logprobs"] == single["prompt_logprobs"] and single["prompt_logprobs"] is not None
    assert piped["preemptions"] > 0 and piped["prefix_hit_rate"] > 0
    assert piped["host_hits"] > 0  # pages loaded back from the host tier while batches were in flight
    for run in (piped, one):
        assert run["recompiled"] == 0 and run["pools_empty"], run
    whole, cut, prefix = r["abort"]
    assert prefix and 3 <= cut < whole
    assert piped["occupancy"] > 0.8  # both stages had a batch on most ticks
