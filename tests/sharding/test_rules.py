"""Host-side pieces of sharding, in process: mesh specs, the rule table and the specs derived
from a model's logical axes, KV-head layout, context-parallel metadata, multi-host arguments."""

import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from jaxinfer.cli import build_parser
from jaxinfer.config import EngineConfig
from jaxinfer.models.llama.model import PARAM_AXES, param_shapes
from jaxinfer.models.moe.model import PARAM_AXES as MOE_AXES
from sharding import AXES, HeadLayout, logical_to_spec, make_mesh, parse_mesh_spec
from sharding.multihost import DistributedArgs, initialize
from sharding.placement import repeat_kv_heads


def mesh(data=1, sequence=1, tensor=1, expert=1, stage=1):
    return AbstractMesh((data, stage, sequence, expert, tensor), AXES)


def test_parse_mesh_spec():
    one = {"data": 1, "stage": 1, "sequence": 1, "expert": 1, "tensor": 1}
    assert parse_mesh_spec("data=2,tensor=4") == {**one, "data": 2, "tensor": 4}
    assert parse_mesh_spec(" tensor = 8 ") == {**one, "tensor": 8}
    assert parse_mesh_spec({"sequence": 4}) == {**one, "sequence": 4}
    assert parse_mesh_spec("expert=4,tensor=2") == {**one, "expert": 4, "tensor": 2}
    assert parse_mesh_spec("stage=2,tensor=4") == {**one, "stage": 2, "tensor": 4}


@pytest.mark.parametrize(
    "spec,message",
    [
        ("", "mesh spec must be"),
        ("tensor", "is not axis=size"),
        ("model=2", "unknown axis 'model'"),
        ("tensor=2,tensor=2", "given twice"),
        ("tensor=0", "positive size"),
        ({"tensor": -1}, "positive size"),
    ],
)
def test_bad_mesh_specs_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_mesh_spec(spec)


def test_mesh_needing_more_devices_than_exist():
    with pytest.raises(ValueError, match="needs 1024 devices"):
        make_mesh("tensor=1024")


def test_engine_config_mesh_is_validated_and_normalised():
    assert EngineConfig(mesh="tensor=2").parallel.mesh == "data=1,stage=1,sequence=1,expert=1,tensor=2"
    assert EngineConfig(mesh={"data": 2}).parallel.mesh == "data=2,stage=1,sequence=1,expert=1,tensor=1"
    with pytest.raises(ValueError, match="unknown axis"):
        EngineConfig(mesh="pipeline=2")


def test_param_specs_follow_the_rule_table():
    shapes = param_shapes(_config())  # 8 heads, 2 KV heads
    m = mesh(tensor=2)
    specs = {name: logical_to_spec(PARAM_AXES[name], shapes[name], m) for name in PARAM_AXES}
    assert specs["wq"] == P(None, "tensor", None) and specs["wk"] == P(None, "tensor", None)
    assert specs["wo"] == P("tensor", None, None)
    assert specs["w_gate"] == specs["w_up"] == P(None, "tensor") and specs["w_down"] == P("tensor", None)
    # Fused weights split like their parts: q|k|v groups by KV head, gate|up by MLP column.
    assert specs["w_qkv"] == P(None, "tensor", None, None) and specs["b_qkv"] == P("tensor", None, None)
    assert specs["w_gate_up"] == P(None, None, "tensor")
    assert specs["embed"] == P("tensor", None) and specs["lm_head"] == P(None, "tensor")
    assert specs["attn_norm"] == specs["final_norm"] == P(None)
    assert specs["q_norm"] == specs["k_norm"] == P(None)  # Qwen3's QK-norm: [D], on every shard
    # Stacked experts [X, E, 2, F] / [X, F, E]: F over tensor like a dense MLP; X whole without
    # an expert axis, split over it with one.
    assert logical_to_spec(MOE_AXES["experts_gate_up"], (4, 64, 2, 32), m) == P(None, None, None, "tensor")
    assert logical_to_spec(MOE_AXES["experts_down"], (4, 32, 64), m) == P(None, "tensor", None)
    ep = mesh(expert=4, tensor=2)
    assert logical_to_spec(MOE_AXES["experts_gate_up"], (4, 64, 2, 32), ep) == P("expert", None, None, "tensor")
    assert logical_to_spec(MOE_AXES["experts_down"], (4, 32, 64), ep) == P("expert", "tensor", None)
    assert logical_to_spec(PARAM_AXES["wq"], shapes["wq"], ep)[1] == "tensor"  # attention: by heads only
    assert MOE_AXES["expert_up.3"] == PARAM_AXES["w_up"] and MOE_AXES["router"] == ("embed", "experts")
    # Without a tensor axis nothing is split.
    assert logical_to_spec(PARAM_AXES["wq"], shapes["wq"], mesh(data=2)) == P(None, None, None)


def test_indivisible_axes():
    with pytest.raises(ValueError, match="'mlp' of size 128 cannot be split over mesh axis 'tensor' of size 3"):
        logical_to_spec(("embed", "mlp"), (64, 128), mesh(tensor=3))
    assert logical_to_spec(("vocab", "embed"), (32001, 64), mesh(tensor=2)) == P(None, None)  # kept whole


@pytest.mark.parametrize(
    "heads,kv,tp,repeat,per_device",
    [
        (8, 2, 1, 1, 2),
        (8, 2, 2, 1, 1),
        (8, 2, 4, 2, 1),
        (8, 2, 8, 4, 1),
        (4, 1, 4, 4, 1),
        (32, 8, 4, 1, 2),
    ],
)
def test_head_layout(heads, kv, tp, repeat, per_device):
    layout = HeadLayout(heads, kv, tp)
    assert (layout.kv_repeat, layout.kv_heads_per_device) == (repeat, per_device)


def test_head_layout_errors():
    with pytest.raises(ValueError, match="tensor=3 must divide the 8 attention heads"):
        HeadLayout(8, 2, 3)
    with pytest.raises(ValueError, match="must divide one another"):
        HeadLayout(12, 4, 6)


def test_repeated_kv_heads_serve_the_right_query_heads():
    heads, kv, tp = 8, 2, 4
    wk = np.arange(kv)[None, :, None] * np.ones((3, kv, 5))  # [E, K, D], head j filled with j
    rep = repeat_kv_heads(wk, ("embed", "kv_heads", "head_dim"), tp // kv)
    group = heads // kv
    for shard in range(tp):  # shard s holds query heads [s*H/tp, (s+1)*H/tp) and kv head s
        for qh in range(shard * heads // tp, (shard + 1) * heads // tp):
            assert rep[0, shard, 0] == qh // group


def test_distributed_args_from_flags_and_environment():
    env = {"JAXINFER_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAXINFER_NUM_PROCESSES": "4", "JAXINFER_PROCESS_ID": "2"}
    assert DistributedArgs.from_env(env=env) == DistributedArgs("10.0.0.1:1234", 4, 2)
    assert DistributedArgs.from_env("h:1", None, 0, env=env) == DistributedArgs("h:1", 4, 0)
    with pytest.raises(ValueError, match="num_processes='x' must be int"):
        DistributedArgs.from_env(env={"JAXINFER_NUM_PROCESSES": "x"})


def test_initialize_single_process_and_bad_arguments(monkeypatch):
    for name in ("COORDINATOR_ADDRESS", "NUM_PROCESSES", "PROCESS_ID"):
        monkeypatch.delenv("JAXINFER_" + name, raising=False)
    assert initialize() is False
    with pytest.raises(ValueError, match="need a coordinator address"):
        initialize(num_processes=2, process_id=1)
    with pytest.raises(ValueError, match="needs --num-processes and --process-id"):
        initialize("127.0.0.1:1")
    with pytest.raises(ValueError, match=r"process_id=3 must be in \[0, 2\)"):
        initialize("127.0.0.1:1", 2, 3)


def test_cli_takes_mesh_and_multihost_flags():
    args = build_parser().parse_args(
        [
            "generate",
            "hi",
            "--mesh",
            "data=2,tensor=4",
            "--coordinator-address",
            "10.0.0.1:8476",
            "--num-processes",
            "2",
            "--process-id",
            "1",
        ]
    )
    assert (args.mesh, args.coordinator_address, args.num_processes, args.process_id) == (
        "data=2,tensor=4",
        "10.0.0.1:8476",
        2,
        1,
    )


def _config():
    from jaxinfer.config import ModelConfig

    return ModelConfig(
        model_type="llama",
        family="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=1e4,
        max_position_embeddings=256,
    )


def test_replicated_kv_heads_deal_out_each_groups_query_heads():
    """tensor=4 over 2 KV heads: a fused [E, 2, 4+2, D] weight becomes [E, 4, 2+2, D], the same
    layout as fusing the placed parts (query heads in KV-head order, K and V repeated)."""
    from sharding.placement import repeat_kv_heads

    rng = np.random.default_rng(0)
    wq, wk, wv = rng.normal(size=(3, 8, 5)), rng.normal(size=(3, 2, 5)), rng.normal(size=(3, 2, 5))
    fused = np.concatenate([wq.reshape(3, 2, 4, 5), wk[:, :, None], wv[:, :, None]], axis=2)
    wk4, wv4 = np.repeat(wk, 2, axis=1), np.repeat(wv, 2, axis=1)
    expected = np.concatenate([wq.reshape(3, 4, 2, 5), wk4[:, :, None], wv4[:, :, None]], axis=2)
    np.testing.assert_array_equal(repeat_kv_heads(fused, PARAM_AXES["w_qkv"], 2), expected)


def test_expert_axis_must_divide_the_experts():
    from sharding.experts import check_expert_axis

    check_expert_axis(mesh(expert=4, tensor=2), 8)
    check_expert_axis(mesh(tensor=2), 0)  # no expert axis: any model
    with pytest.raises(ValueError, match="expert=4 cannot split 6 experts"):
        check_expert_axis(mesh(expert=4), 6)
    with pytest.raises(ValueError, match="expert=2 cannot split a model without experts"):
        check_expert_axis(mesh(expert=2), 0)
