"""A KV cache split along the sequence (pallas_kernels/split_rows.py): N shards, each holding its
rows of every page, write the step's K/V into exactly their rows of the whole cache, and their
partial softmaxes, merged by log-sum-exp, give the reference's attention over the whole cache
(prefill chunks, decode tokens, padding, a sliding window, an int8 cache), on poisoned caches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rpa_cases import make_case

from pallas_kernels.reference import ragged_paged_attention_reference
from pallas_kernels.split_rows import attend_rows
from sharding.attention import merge_carries

CASES = [
    ([5, 1, 1, 9], [37, 18, 1, 9], {}),  # chunked prefill, two decodes, a first chunk
    ([1, 1, 1], [64, 33, 100], dict(sliding_window=24)),
    ([3, 1], [40, 20], dict(cache_dtype=jnp.int8)),
]


def rows_of(cache: jax.Array, shard: int, shards: int) -> jax.Array:
    rows = cache.shape[1] // shards
    return cache[:, shard * rows : (shard + 1) * rows]


@pytest.mark.parametrize("shards", [2, 4])
@pytest.mark.parametrize("q_lens,kv_lens,options", CASES, ids=["prefill-decode", "window", "int8"])
def test_shards_merged_equal_the_whole_cache(shards, q_lens, kv_lens, options):
    window = options.get("sliding_window")
    case = make_case(q_lens, kv_lens, cache_dtype=options.get("cache_dtype"), seed=len(q_lens) + shards)
    args, scales = case.args(), case.scales()
    whole_out, whole_cache = ragged_paged_attention_reference(*args, sm_scale=0.125, sliding_window=window, **scales)
    q, k, v, cache, *meta = args
    carries = []
    for shard in range(shards):
        carry, written = attend_rows(
            q,
            k,
            v,
            rows_of(cache, shard, shards),
            *meta,
            shard,
            shards,
            sm_scale=0.125,
            sliding_window=window,
            **scales,
        )
        # Exactly this shard's rows of the whole cache after the write, poison where it was.
        np.testing.assert_array_equal(np.asarray(written), np.asarray(rows_of(whole_cache, shard, shards)))
        carries.append(carry)
    stacked = jax.tree.map(lambda *c: jnp.stack(c), *carries)
    merged = jax.vmap(lambda c: merge_carries(c, "shard"), axis_name="shard")(stacked)[0]  # [T, K, G, D]
    out = merged.reshape(whole_out.shape)
    real = int(case.cu_q_lens[int(case.num_seqs[0])])
    np.testing.assert_allclose(np.asarray(out[:real]), np.asarray(whole_out[:real], np.float32), rtol=2e-5, atol=2e-5)
    assert np.isfinite(np.asarray(out)).all()
