"""LoRA adapters on meshes of 8 forced CPU devices: a batch mixing three adapters and the base
model gives each request exactly the tokens it gets alone on one device, with the heads (and the
adapters' B of q|k|v) split over tensor=3, with two data replicas of tensor=3 each, and over
tensor=6 (each KV head stored twice, as the weights store it); one adapter adapts the embedding
and the LM head too, their stacks split along the vocabulary like the embedding."""


def test_mixed_adapters_on_tensor_and_data_meshes(scenario):
    r = scenario("lora", "tensor=3", "data=2,tensor=3", "tensor=6", timeout=900)
    assert r["distinct"] > r["num_requests"] // 2  # the adapters change the outputs
    for mesh in ("tensor=3", "data=2,tensor=3", "tensor=6"):
        assert r[mesh]["mismatched"] == [], f"{mesh}: {r[mesh]['mismatched']}"
        assert r[mesh]["recompiled"] == 0 and r[mesh]["loads"] >= 3  # three adapters through two slots
        # B of q|k|v [slots, R, K, G+2, D]: one KV head per tensor shard; with tensor=6 each of
        # the 3 KV heads is stored twice, each copy with one of its group's 2 query heads
        assert r[mesh]["b_shard"][:4] == ([2, 8, 1, 4] if mesh != "tensor=6" else [2, 8, 1, 3])
        # the LM head's B [slots, R, V] and the embedding's A [slots, V, R]: V = 768 split 3 or 6 ways
        part = 768 // (6 if mesh == "tensor=6" else 3)
        assert r[mesh]["head_b_shard"] == [2, 8, part] and r[mesh]["embed_a_shard"] == [2, part, 8]
