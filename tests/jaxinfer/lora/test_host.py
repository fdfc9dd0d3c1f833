"""LoRA on the host, no JAX: PEFT adapters read and refused, the device slots' bookkeeping with
exact slot ids, the registry's host cache and hash roots, the options, and the scheduler's
admission when every slot is in use."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from lora_adapters import write_random_adapter
from testpaths import FIXTURES

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.config.lora import LINEAR_MODULES, LoraModule
from jaxinfer.core.scheduler import Scheduler
from jaxinfer.kv import KVCacheManager
from jaxinfer.lora import AdapterError, AdapterRegistry, AdapterSlots, LoRARequest, read_adapter
from jaxinfer.lora.peft import adapted_modules
from jaxinfer.lora.stacking import layer_slot, slot_shapes
from jaxinfer.sampling.params import SamplingParams

LLAMA3 = FIXTURES / "hf" / "llama3"
ADAPTER = FIXTURES / "lora" / "llama3_all_r8"
DIMS = {  # the llama3 fixture: hidden 64, 8 heads x 16, 2 KV heads, MLP 128
    "q_proj": (64, 128),
    "k_proj": (64, 32),
    "v_proj": (64, 32),
    "o_proj": (128, 64),
    "gate_proj": (64, 128),
    "up_proj": (64, 128),
    "down_proj": (128, 64),
}


@pytest.fixture(scope="module")
def config():
    return ModelConfig.from_hf_file(LLAMA3 / "config.json")


def _random(path, **kw):
    args = dict(num_layers=2, dims=DIMS, target_modules=list(DIMS), r=4, lora_alpha=8, use_rslora=False, seed=1)
    write_random_adapter(path, **{**args, **kw})
    return path


def test_reads_a_peft_adapter_with_its_scale(config, tmp_path):
    adapter = read_adapter(ADAPTER, config, max_rank=16)
    assert adapter.rank == 8 and adapter.scale == 16 / 8
    assert adapter.target_modules == list(DIMS)
    assert len(adapter.weights) == 2 * 7
    a, b = adapter.weights[(1, "k_proj")]
    assert a.shape == (8, 64) and b.shape == (32, 8)
    rs = read_adapter(_random(tmp_path / "rs", r=4, lora_alpha=8, use_rslora=True), config, max_rank=16)
    assert rs.scale == pytest.approx(8 / 2)  # alpha / sqrt(r)


def _corrupted(tmp_path, name, change):
    path = tmp_path / name
    shutil.copytree(ADAPTER, path)
    change(path)
    return path


@pytest.mark.parametrize(
    "name,change,match",
    [
        ("missing", lambda p: shutil.rmtree(p), "not a directory"),
        ("no_config", lambda p: (p / "adapter_config.json").unlink(), "no adapter_config.json"),
        ("bad_json", lambda p: (p / "adapter_config.json").write_text("{r: 8"), "not valid JSON"),
        ("no_weights", lambda p: (p / "adapter_model.safetensors").unlink(), "no adapter_model.safetensors"),
        (
            "truncated",
            lambda p: (p / "adapter_model.safetensors").write_bytes(
                (p / "adapter_model.safetensors").read_bytes()[:4000]
            ),
            "truncated",
        ),
        ("dora", lambda p: _edit(p, use_dora=True), "DoRA"),
        ("bias", lambda p: _edit(p, bias="all"), "bias='all'"),
        ("not_lora", lambda p: _edit(p, peft_type="PREFIX_TUNING"), "is not LORA"),
        ("saved_modules", lambda p: _edit(p, modules_to_save=["lm_head"]), "modules_to_save"),
        ("conv1d", lambda p: _edit(p, fan_in_fan_out=True), "fan_in_fan_out"),
        ("alora", lambda p: _edit(p, alora_invocation_tokens=[1, 2]), "activated LoRA"),
    ],
)
def test_bad_adapters_are_refused_by_name(config, tmp_path, name, change, match):
    path = _corrupted(tmp_path, name, change)
    with pytest.raises(AdapterError, match=match) as e:
        read_adapter(path, config, max_rank=16)
    assert name in str(e.value)  # the adapter's path is named


def _edit(path, **changes):
    file = path / "adapter_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


def test_rank_shape_and_module_mismatches_are_refused(config, tmp_path):
    with pytest.raises(AdapterError, match="rank 8 is above max_lora_rank=4"):
        read_adapter(ADAPTER, config, max_rank=4)
    other = _random(tmp_path / "other", dims={**DIMS, "q_proj": (96, 128)})  # another model's hidden size
    with pytest.raises(AdapterError, match=r"layer 0 q_proj: lora_A \(4, 96\).*another model"):
        read_adapter(other, config, max_rank=16)
    deep = _random(tmp_path / "deep", num_layers=3)
    with pytest.raises(AdapterError, match="for layer 2, but the model has 2 layers"):
        read_adapter(deep, config, max_rank=16)
    head = _random(tmp_path / "head")
    from safetensors.numpy import load_file, save_file

    tensors = load_file(head / "adapter_model.safetensors")
    tensors["base_model.model.lm_head.lora_A.weight"] = np.ones((4, 64), np.float32)
    save_file(tensors, head / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="lm_head: has lora_A but not both"):
        read_adapter(head, config, max_rank=16)
    tensors["base_model.model.lm_head.lora_B.weight"] = np.ones((config.vocab_size + 1, 4), np.float32)
    save_file(tensors, head / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=r"lm_head: lora_A \(4, 64\) / lora_B .*another model"):
        read_adapter(head, config, max_rank=16)
    tensors["base_model.model.lm_head.lora_B.weight"] = np.ones((config.vocab_size, 4), np.float32)
    save_file(tensors, head / "adapter_model.safetensors")
    assert read_adapter(head, config, max_rank=16).target_modules[-1] == "lm_head"
    assert adapted_modules(head) == {*LINEAR_MODULES, "lm_head"}
    with pytest.raises(AdapterError, match="adapts lm_head .*slots do not hold.*--lora-target-modules"):
        read_adapter(head, config, max_rank=16, modules=LINEAR_MODULES)
    moe = ModelConfig.from_hf_file(FIXTURES / "hf" / "mixtral" / "config.json")
    with pytest.raises(AdapterError):  # experts are not adapted (here the shapes differ too)
        read_adapter(ADAPTER, moe, max_rank=16)


def test_slot_layout_places_each_module_in_its_columns(config):
    adapter = read_adapter(ADAPTER, config, max_rank=16)
    slot = layer_slot(adapter, config, 16, 0, np.float32)
    shapes = slot_shapes(config, 16)
    assert {f: (a.shape, b.shape) for f, (a, b) in slot.items()} == shapes
    a, b = slot["w_qkv"]  # [E, 3R], [R, K, G+2, D]: the three modules share B's rows
    qa, qb = adapter.weights[(0, "q_proj")]
    ka, kb = adapter.weights[(0, "k_proj")]
    va, vb = adapter.weights[(0, "v_proj")]
    np.testing.assert_array_equal(a[:, :8], qa.T)
    np.testing.assert_array_equal(a[:, 32:40], va.T)
    assert not a[:, 8:16].any() and not b[8:].any()  # rank padding
    np.testing.assert_allclose(b[:8, :, :4].reshape(8, -1), (qb * adapter.scale).T)  # q heads, KV-grouped
    np.testing.assert_allclose(b[:8, :, 4], (kb * adapter.scale).T.reshape(8, 2, 16))  # K, then V
    np.testing.assert_allclose(b[:8, :, 5], (vb * adapter.scale).T.reshape(8, 2, 16))
    gate_b = slot["w_gate_up"][1]  # [R, 2, F]
    np.testing.assert_allclose(gate_b[:8, 1], (adapter.weights[(0, "up_proj")][1] * adapter.scale).T)
    empty = layer_slot(None, config, 16, 0, np.float32)
    assert not any(x.any() for pair in empty.values() for x in pair)


def test_slots_lru_with_exact_ids():
    slots = AdapterSlots(2)
    assert slots.acquire("a") == 1 and slots.acquire("b") == 2
    assert slots.take_loads() == [(1, "a"), (2, "b")]
    assert slots.acquire("c") is None  # both in use
    assert slots.acquire("a") == 1 and slots.users("a") == 2 and slots.take_loads() == []
    slots.release("a"), slots.release("a")
    assert slots.acquire("c") == 1  # a's slot was idle: c takes it
    assert slots.take_loads() == [(1, "c")]
    slots.release("b")
    slots.release("c")
    assert slots.acquire("b") == 2 and slots.take_loads() == []  # still loaded: no write
    assert slots.acquire("d") == 1  # the least recently used idle slot (c's)
    with pytest.raises(ValueError, match="in use"):
        slots.drop("b")
    slots.release("b")
    slots.drop("b")
    assert slots.loaded == {"d": 1}
    assert slots.acquire("e") == 2
    with pytest.raises(ValueError, match="no users"):
        slots.release("zzz")


def test_registry_host_cache_and_roots(config, tmp_path):
    registry = AdapterRegistry(config, max_rank=16, capacity=1)
    a = registry.add("a", str(ADAPTER))
    b = registry.add("b", str(_random(tmp_path / "b")))
    assert registry.num_in_host_memory == 1  # a dropped from host memory ...
    assert registry.adapter("a").rank == 8  # ... and read again when needed
    assert registry.add("a", str(ADAPTER)) is a  # the same name and path: the same entry
    with pytest.raises(AdapterError, match="already loaded from"):
        registry.add("a", str(tmp_path / "b"))
    with pytest.raises(AdapterError, match="not loaded and no path"):
        registry.resolve(LoRARequest("c", 3))
    assert len({a.hash_root, b.hash_root}) == 2
    registry.remove("a")
    again = registry.add("a", str(ADAPTER))
    assert again.hash_root != a.hash_root  # loaded again: no page of the old load is reused


def test_lora_options():
    cfg = EngineConfig(enable_lora=True, lora_modules=["x=/a", '{"name": "y", "path": "/b"}'], max_cpu_loras=8)
    assert cfg.lora.lora_modules == (LoraModule("x", "/a"), LoraModule("y", "/b"))
    assert cfg.lora.host_capacity == 8 and EngineConfig(enable_lora=True).lora.host_capacity == 4
    assert EngineConfig(lora_modules=["x=/a"]).lora.enable_lora  # naming adapters turns LoRA on
    for options, match in (
        ({"enable_lora": True, "lora_modules": ["x"]}, "NAME=PATH"),
        ({"enable_lora": True, "lora_modules": ["x=/a", "x=/b"]}, "given twice"),
        ({"enable_lora": True, "max_cpu_loras": 2}, "at least max_loras=4"),
        ({"enable_lora": True, "max_lora_rank": 0}, "max_lora_rank must be a positive"),
    ):
        with pytest.raises(ValueError, match=match):
            EngineConfig(**options)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/a")


def _scheduler(slots, num_pages=64):
    kv = KVCacheManager(num_pages, 4)
    return Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64, adapter_slots=slots)


def test_a_request_waits_for_a_slot_while_others_run():
    slots = AdapterSlots(1)
    sched = _scheduler(slots)
    params = SamplingParams(max_tokens=4)
    sched.add_request("a", list(range(1, 10)), params, adapter="a", hash_root=b"a" * 16)
    sched.add_request("b", list(range(1, 10)), params, adapter="b", hash_root=b"b" * 16)
    sched.add_request("base", list(range(1, 10)), params)
    plan = sched.schedule()
    assert [s.seq.request_id for s in plan.seqs] == ["a", "base"]  # b waits: the one slot holds a
    assert [s.seq.lora_slot for s in plan.seqs] == [1, 0]
    assert slots.take_loads() == [(1, "a")]
    sched.abort("a")  # a's slot is idle now
    plan = sched.schedule()
    assert "b" in [s.seq.request_id for s in plan.seqs] and slots.take_loads() == [(1, "b")]


def test_the_same_prompt_under_two_adapters_shares_no_page():
    sched = _scheduler(AdapterSlots(2))
    prompt = list(range(1, 18))  # four full pages of 4
    params = SamplingParams(max_tokens=1)
    for rid, adapter in (("a1", "a"), ("b1", "b"), ("a2", "a")):
        sched.add_request(rid, prompt, params, adapter=adapter, hash_root=adapter.encode() * 16)
        plan = sched.schedule()
        sched.update(plan, [7] * len(plan.seqs))
        while sched.has_unfinished():
            plan = sched.schedule()
            sched.update(plan, [7] * len(plan.seqs))
    assert sched.kv_cache.prefix_cache_hits == 16  # a2 reused a1's four pages; b1 none of them


def test_combinations_not_served_are_refused_at_start_up(config):
    from jaxinfer.config import LoraConfig, SpeculativeConfig
    from jaxinfer.lora.manager import build_manager

    lora = LoraConfig(enable_lora=True)
    write = lambda slot, adapter: None  # noqa: E731
    assert build_manager(LoraConfig(), config, write, None, False) is None  # LoRA off
    draft = SpeculativeConfig.parse({"method": "draft_model", "model": "/m", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="draft model .* with adapters is not supported"):
        build_manager(lora, config, write, draft, False)
    with pytest.raises(ValueError, match="several hosts"):
        build_manager(lora, config, write, None, True)
    manager = build_manager(LoraConfig(lora_modules=[f"a={ADAPTER}"]), config, write, None, False)
    assert [e.name for e in manager.adapters] == ["a"] and manager.requests_per_adapter() == {"a": 0}


def test_target_modules_the_slots_hold():
    """lora_target_modules names them ('all': the nine); by default the seven linear modules, and
    the embedding and the LM head where an adapter named at start-up adapts them."""
    from jaxinfer.config import LoraConfig
    from jaxinfer.config.lora import TARGET_MODULES
    from jaxinfer.lora.stacking import served_fields, served_modules

    vocab = FIXTURES / "lora" / "llama3_vocab_r8"
    assert served_modules(LoraConfig(enable_lora=True)) == LINEAR_MODULES
    assert served_modules(LoraConfig(lora_modules=[f"v={vocab}"])) == TARGET_MODULES
    assert served_modules(LoraConfig(lora_modules=[f"v={vocab / 'missing'}"])) == LINEAR_MODULES
    assert served_modules(LoraConfig(lora_target_modules=["all"])) == TARGET_MODULES
    held = LoraConfig(lora_target_modules=["lm_head", "v_proj", "down_proj"]).lora_target_modules
    assert held == ("v_proj", "down_proj", "lm_head") and served_fields(held) == ["w_qkv", "w_down"]
    with pytest.raises(ValueError, match=r"lora_target_modules=\['lm_head', 'wq'\]: expected 'all' or names among"):
        EngineConfig(lora_target_modules=["lm_head", "wq"])


def test_embedding_and_lm_head_adapters_are_read(config, tmp_path):
    """PEFT's names and shapes for the embedding (lora_embedding_A [r, vocab], lora_embedding_B
    [hidden, r]) and the LM head; the base weights PEFT saves beside them are checked, not read."""
    from safetensors.numpy import load_file, save_file

    vocab = FIXTURES / "lora" / "llama3_vocab_r8"
    adapter = read_adapter(vocab, config, max_rank=8)
    assert adapter.target_modules[-2:] == ["embed_tokens", "lm_head"] and len(adapter.weights) == 2 * 7
    assert [adapter.vocab[m][0].shape for m in ("embed_tokens", "lm_head")] == [(8, 512), (8, 64)]
    copy = Path(shutil.copytree(vocab, tmp_path / "resized"))
    tensors = load_file(copy / "adapter_model.safetensors")
    tensors["base_model.model.model.embed_tokens.base_layer.weight"] = np.zeros((520, 64), np.float32)
    save_file(tensors, copy / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=r"embed_tokens.base_layer.weight has shape \(520, 64\), not the base"):
        read_adapter(copy, config, max_rank=8)
