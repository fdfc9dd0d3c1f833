"""The engine on meshes of 8 forced CPU devices, each configuration in its own process:
greedy outputs equal to the single-device run (= HF generate) for tensor, data x tensor (with
the prefix cache's host tier), sequence (the cache split along the sequence) and stage (pipeline)
meshes, and a context 6x one device's pool served by 8; logits within float32 tolerance; the
decode step's collectives; parameter bytes per device; ring and all-gather context attention."""

import re

import pytest

ENGINE_CASES = [
    ("llama3", "tensor=2"),  # 2 KV heads: one per shard
    ("llama3", "tensor=4"),  # 2 KV heads < 4 shards: each KV head stored twice
    ("llama3", "tensor=8"),  # one query head per shard
    ("llama3", "data=2,tensor=4"),  # two replicas, each 4-way tensor parallel
    ("llama3", "sequence=4"),  # tokens and each page's rows split over 4 devices
    ("llama3", "data=2,sequence=2,tensor=2"),  # all three axes at once
    ("mistral", "tensor=4"),  # 1 KV head, sliding window
    ("qwen3_tied", "tensor=2"),  # QK-norm, 1 KV head stored twice, tied LM head
    ("mixtral", "tensor=2"),  # experts' F split over tensor, 1 KV head stored twice
    ("mixtral", "expert=4,tensor=2"),  # one whole expert per expert shard, its F split in two
    ("qwen3_moe", "data=2,expert=2,tensor=2"),  # replicas x experts x tensor
    ("llama3", "data=2,stage=2"),  # two replicas, each a two-stage pipeline
    ("qwen3_moe", "stage=2"),  # 3 layers in stages of 2 and 1 (a padding slot), experts staged too
    ("llama3", "stage=2,sequence=2,tensor=2"),  # each device: a stage's layers, a quarter of each page's rows
]


@pytest.mark.parametrize("name,mesh", ENGINE_CASES, ids=[f"{n}-{m}" for n, m in ENGINE_CASES])
def test_greedy_outputs_equal_single_device(scenario, name, mesh):
    offload = mesh == "data=2,tensor=4"  # with the host tier: a pool per replica, heads split over tensor
    r = scenario("engine", name, mesh, *(["0.01"] if offload else []))
    assert r["mismatched"] == [], f"{r['mismatched']} of {r['num_prompts']} prompts differ"
    if offload:  # preempted sequences came back from host pages
        assert r["host_hits"] > 0, r
    assert r["recompiled"] == 0 and r["pools_empty"]
    if name == "llama3":
        assert r["preemptions"] > 0  # the 24-page pool forces preemption (as in test_engine)
    sizes = dict(item.split("=") for item in mesh.split(","))
    tp, dp = int(sizes.get("tensor", 1)), int(sizes.get("data", 1))
    # A batch in flight on each pipeline stage (worker/pipelined.py); with data replicas one at a time.
    assert r["in_flight"] == (int(sizes.get("stage", 1)) if dp == 1 else 1)
    kv_heads = {"llama3": 2, "mistral": 1, "qwen3_tied": 1, "mixtral": 1, "qwen3_moe": 2}[name]
    # The cache is split by KV heads: each shard holds max(1, K / tp) heads (K and V).
    assert r["cache_shard_shape"][-2] == 2 * max(1, kv_heads // tp)
    # Each stage's devices, and each shard of `sequence`, hold their rows of every page.
    row_split = int(sizes.get("stage", 1)) * int(sizes.get("sequence", 1))
    assert r["cache_shape"][-3] == row_split * r["cache_shard_shape"][-3]
    if dp > 1:
        assert r["cache_shape"][0] == dp and r["cache_shard_shape"][0] == 1
        counts = r["requests_per_replica"]
        assert sum(counts) == r["num_prompts"] and max(counts) - min(counts) <= 1  # balanced


def test_a_context_six_times_one_devices_pool_with_the_cache_split_along_the_sequence(scenario):
    """sequence=8: each device holds 2 of every page's 16 rows, 40 tokens of the 20-page pool,
    and a 240-token prompt (6x that) decodes to the tokens of one device holding the whole pool."""
    r = scenario("kvsplit", "sequence=8", "240")
    one, split = r["none"], r["sequence=8"]
    assert split["tokens"] == one["tokens"] and len(one["tokens"]) == 8
    assert split["recompiled"] == 0 and split["pools_empty"]
    assert split["num_pages"] == one["num_pages"] == 20 and split["page_size"] == one["page_size"] == 16
    assert split["rows_per_device"] == 2 and one["rows_per_device"] == 16
    assert split["cache_bytes_per_device"] * 8 == one["cache_bytes_per_device"]
    assert 240 >= 6 * split["num_pages"] * split["rows_per_device"]  # 6x what a device holds


LOGIT_CASES = [
    "llama3:tensor=8",
    "mistral:tensor=4",
    "qwen2:tensor=4",
    "tied_gqa3:tensor=2",
    "llama3:sequence=4",
    "qwen2:sequence=2,tensor=2",
    "qwen3:tensor=2",
    "qwen3_tied:tensor=2",
    "mixtral:tensor=4",
    "qwen3_moe:tensor=2",
    "mixtral:expert=4,tensor=2",
    "qwen3_moe:expert=8",
]


@pytest.fixture(scope="module")
def logits(scenario):
    return scenario("logits", ";".join(LOGIT_CASES))


@pytest.mark.parametrize("case", LOGIT_CASES)
def test_logits_within_float32_tolerance(logits, case):
    r = logits[case]
    assert r["max_diff_single"] < 1e-4, r
    assert r["max_diff_hf"] < 1e-3 and r["argmax_equal"], r


EXPERT_MESHES = ["expert=4,tensor=2", "expert=8", "expert=2", "tensor=4", "sequence=2,expert=4"]


def test_expert_parallel_mlp_matches_one_device(scenario):
    """Both forms of the MoE MLP (dense; ragged: grouped matmuls) with the stacked experts split
    over `expert` (whole experts per device) and their MLP width over `tensor`."""
    r = scenario("experts", ";".join(EXPERT_MESHES))
    for mesh in EXPERT_MESHES:
        sizes = dict(item.split("=") for item in mesh.split(","))
        ep, tp = int(sizes.get("expert", 1)), int(sizes.get("tensor", 1))
        assert max(r[mesh]["max_diff"].values()) < 1e-5, (mesh, r[mesh])
        assert r[mesh]["gate_up_shard"] == [8 // ep, 48, 2, 32 // tp], (mesh, r[mesh])
        assert r[mesh]["down_shard"] == [8 // ep, 32 // tp, 48], (mesh, r[mesh])


@pytest.mark.parametrize("quant,packed", [("int8", 1), ("int4:8", 2)])
def test_expert_parallel_mlp_on_quantized_experts(scenario, quant, packed):
    """The same on quantized experts: integers split as the float weight is (int4 holds two F
    inputs a byte along w_down's split F), scales with them, and both forms equal to one device."""
    meshes = ["expert=4,tensor=2", "sequence=2,expert=4"]
    r = scenario("experts", ";".join(meshes), quant)
    for mesh in meshes:
        ep, tp = 4, 2 if "tensor" in mesh else 1
        assert max(r[mesh]["max_diff"].values()) < 1e-5, (mesh, r[mesh])
        assert r[mesh]["gate_up_shard"] == [8 // ep, 48 // packed, 2, 32 // tp], (mesh, r[mesh])
        assert r[mesh]["down_shard"] == [8 // ep, 32 // tp // packed, 48], (mesh, r[mesh])


def _shape(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text.split("[", 1)[1])] if "[" in text else []


def test_decode_step_collectives_and_parameter_memory(scenario):
    r = scenario("hlo", "llama3", "tensor=4")
    layers, hidden, vocab = r["num_layers"], r["hidden"], r["vocab"]
    residual = [c for c in r["collectives"] if c == ["all-reduce", f"f32[8,{hidden}]"]]
    # One all-reduce of the [T, E] activations after each attention and each MLP, plus one for
    # the vocab-sharded embedding lookup.
    assert len(residual) == 2 * layers + 1, r["collectives"]
    gathers = [shape for kind, shape in r["collectives"] if kind == "all-gather"]
    assert gathers, "the vocab-sharded logits must be gathered for sampling"
    weight_shapes = [_shape(s) for s in r["weight_shapes"]]
    for shape in gathers:  # only [S, ...] activations (S = 8 sequences) are ever gathered
        dims = _shape(shape)
        assert dims[0] == 8 and dims[1:] <= [vocab], shape
        assert dims not in weight_shapes, f"a weight is all-gathered: {shape}"
    assert all(kind in ("all-reduce", "all-gather") for kind, _ in r["collectives"]), r["collectives"]
    # Per device: 1/tensor of every split parameter, whole copies of the small norm weights only.
    assert r["num_devices"] == 4
    split = r["total_bytes"] - r["replicated_bytes"]
    assert r["per_device_bytes"] == [split // 4 + r["replicated_bytes"]] * 4
    assert r["replicated_bytes"] < 0.01 * r["total_bytes"]


def test_ring_and_all_gather_context_attention_match_dense(scenario):
    r = scenario("context", "128,256")
    for length, errors in r.items():
        assert errors["allgather"] < 1e-5 and errors["ring"] < 1e-5, (length, errors)
