"""Orbax checkpoints restored onto meshes (8 simulated CPU devices): each parameter equal to the
loader's placement of the safetensors, with the same sharding, KV heads repeated where tp > K,
and a mesh the saved shapes do not fit refused with the axis named."""

import pytest

CASES = [
    "llama3:tensor=2",  # 2 KV heads, one per shard: every array read as its shards
    "llama3:tensor=4",  # 2 KV heads over 4 shards: wk/wv read whole, repeated on device
    "llama3:tensor=8",  # 4 copies of each KV head
    "llama3:data=2,tensor=4",
    "mistral:tensor=4",  # 1 KV head, repeated 4 times
    "qwen2:tensor=2",  # q/k/v biases
    "tied_gqa3:tensor=2",  # a tied LM head
    "qwen3_tied:tensor=2",  # QK-norm weights (replicated); 1 KV head repeated on device
    "qwen3_moe:tensor=2",  # per-expert tensors split by their MLP width, a dense layer
]


@pytest.fixture(scope="module")
def restored(tmp_path_factory, scenario):
    cases = ";".join(CASES + ["llama3:tensor=3"])
    return scenario("orbax", str(tmp_path_factory.mktemp("orbax")), cases)


@pytest.mark.parametrize("case", list(CASES))
def test_restored_params_equal_the_loaders(restored, case):
    result = restored[case]
    assert "error" not in result, result
    assert result["equal"] and result["same_sharding"], result
    assert result["leaves"] > 0


def test_mesh_that_does_not_fit_is_named(restored):
    assert "tensor=3" in restored["llama3:tensor=3"]["error"]
