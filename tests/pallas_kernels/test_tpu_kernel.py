"""The TPU kernel's own cases in interpret mode: its three paths (decode, mixed, prefill) with
their block configs, the order the paths put sequences in, DMA races, and the shape of its DMAs.
The cases both kernels share are in test_kernels.py."""

import jax
import jax.numpy as jnp
import kernel_mode
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from kernel_check import check, reference, run_tpu
from rpa_cases import make_case

from pallas_kernels import common, tpu, tpu_layout


def test_tpu_rejects_unaligned_head_dim():
    case = make_case(q_lens=[1], kv_lens=[4], head_dim=80)
    with pytest.raises(common.UnsupportedShape, match="head_dim=80"):
        run_tpu(case, sm_scale=0.1)


TPU_CONFIGS = {
    "small_blocks": tpu.TpuConfig(block_q=16, pages_per_block=1),
    "wide_kv_blocks": tpu.TpuConfig(block_q=32, pages_per_block=4),
}


@pytest.mark.parametrize("name", sorted(TPU_CONFIGS))
def test_tpu_configs(name):
    case = make_case(q_lens=[5, 1, 20, 1], kv_lens=[40, 300, 20, 129], page_size=8, seed=13)
    check("tpu", case, config=TPU_CONFIGS[name], sliding_window=64)


# Small blocks, so that every path takes several grid steps and KV steps: sequences of 1 query
# token go to the decode kernel, of 2-15 (or 2-31) to the mixed blocks, longer ones to prefill.
TPU_PATHS = {
    "small_blocks": tpu.TpuPaths(tpu.DecodeConfig(2, 1), tpu.TpuConfig(16, 1), tpu.TpuConfig(16, 2)),
    "wide_blocks": tpu.TpuPaths(tpu.DecodeConfig(3, 4), tpu.TpuConfig(16, 4), tpu.TpuConfig(32, 1)),
}
# Interleaved paths; decodes with nothing cached (kv_len 1) between decodes with long contexts,
# so a decode sequence's first KV step is started by a sequence before it, or by itself.
PATHS_BATCH = dict(
    q_lens=[1, 5, 1, 40, 1, 1, 20, 1, 3, 1, 33], kv_lens=[70, 40, 1, 60, 17, 129, 20, 1, 3, 33, 50], page_size=8
)


@pytest.mark.parametrize("name", sorted(TPU_PATHS))
@pytest.mark.parametrize("window", [None, 24])
def test_tpu_paths(name, window):
    case = make_case(**PATHS_BATCH, seed=14 + (window or 0))
    check("tpu", case, config=TPU_PATHS[name], sliding_window=window)


def test_tpu_path_order():
    """Sequences ordered decode, mixed, prefill, then empty ones, stable within each; the token
    maps are inverse permutations that keep padding tokens in place."""
    case = make_case(**PATHS_BATCH, seed=0)
    order, cu_ordered, counts = tpu_layout.path_order(jnp.asarray(case.cu_q_lens), jnp.asarray(case.num_seqs), 16)
    q_lens = np.diff(case.cu_q_lens)
    assert np.asarray(counts).tolist() == [6, 2, 3]
    assert np.asarray(order).tolist() == [0, 2, 4, 5, 7, 9, 1, 8, 3, 6, 10, 11, 12]
    np.testing.assert_array_equal(np.diff(np.asarray(cu_ordered)), q_lens[np.asarray(order)])
    num_tokens = case.q.shape[0]
    source, dest = (
        np.asarray(x) for x in tpu_layout.token_maps(jnp.asarray(case.cu_q_lens), cu_ordered, order, num_tokens)
    )
    np.testing.assert_array_equal(source[dest], np.arange(num_tokens))
    real = int(case.cu_q_lens[-1])
    np.testing.assert_array_equal(dest[real:], np.arange(real, num_tokens))
    assert source[6] == int(case.cu_q_lens[1])  # the first mixed token: sequence 1's first


def test_tpu_paths_with_quantized_cache():
    case = make_case(**dict(PATHS_BATCH, page_size=32), dtype=jnp.bfloat16, cache_dtype=jnp.int8, seed=15)
    check("tpu", case, config=TPU_PATHS["small_blocks"], soft_cap=5.0)


def test_tpu_dma_races_and_order():
    """The TPU interpreter with race detection and DMAs executed eagerly at start(): one ragged
    call over the batch, and the three paths."""
    kernel_mode.interpret_only()
    case = make_case(q_lens=[5, 1, 20, 1, 1], kv_lens=[40, 70, 20, 1, 30], page_size=8, seed=17)
    want, _ = reference(case)
    for config in (tpu.TpuConfig(16, 2), TPU_PATHS["small_blocks"]):
        for params in (pltpu.InterpretParams(detect_races=True), pltpu.InterpretParams(dma_execution_mode="eager")):
            out, _ = run_tpu(case, config=config, interpret=params, sm_scale=0.125)
            np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=2e-5)


def _kernel_eqns(jaxpr, name):
    """Equations named `name` in a kernel's jaxpr, nested bodies included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _kernel_eqns(sub, name)


def _kernels(case):
    jaxpr = jax.make_jaxpr(lambda *a: tpu.ragged_paged_attention_tpu(*a, **case.scales(), sm_scale=0.1))(*case.args())
    return [eqn.params["jaxpr"] for eqn in _kernel_eqns(jaxpr.jaxpr, "pallas_call")]


def test_tpu_kernels_move_whole_pages():
    """Every DMA of the TPU kernels (decode, mixed and prefill calls) moves whole keys (every kv
    head's K and V rows and every column: [n, 2Hkv, D], contiguous in HBM): a page of all heads
    in one copy, never a per-head slice of the tiled HBM cache."""
    heads, page = 4, 8
    case = make_case(q_lens=[5, 1], kv_lens=[40, 20], num_kv_heads=heads, page_size=page, seed=3)
    kernels = _kernels(case)
    assert len(kernels) == 3
    whole = lambda i, n: isinstance(i, pl.Slice) and i.start == 0 and i.size == n and i.stride == 1  # noqa: E731
    for kernel in kernels:
        sizes = set()
        for eqn in _kernel_eqns(kernel, "dma_start"):
            src, dst = jax.tree_util.tree_unflatten(eqn.params["tree"], eqn.invars)[:2]
            for ref in (src, dst):
                *_, keys, rows, cols = ref.transforms[0].indices
                assert whole(rows, 2 * heads) and whole(cols, case.q.shape[-1]), ref
                assert isinstance(keys, pl.Slice) and keys.stride == 1
                sizes.add(keys.size)
        assert sizes == {1, page}  # a token written, a page fetched from the cache or this step's rows


@pytest.mark.parametrize("cache_dtype,per_word", [(jnp.float32, 1), (jnp.bfloat16, 2), (jnp.int8, 4)])
def test_tpu_kernels_read_a_heads_rows_by_strided_loads(cache_dtype, per_word):
    """Compiled (not interpreted), each kv head's K and V come out of the VMEM buffers of whole
    keys ([2, N, 2Hkv, D]) viewed as rows ([N * 2Hkv, D], as 32-bit words for a packed dtype):
    one strided load of every (2Hkv / packing)-th row from the word holding row 2h. Indexing
    the buffers' row axis instead has Mosaic gather one sublane per key (tpu_rows.py)."""
    heads = 4
    dtype = jnp.float32 if cache_dtype == jnp.float32 else jnp.bfloat16
    case = make_case(
        q_lens=[5, 1, 20],
        kv_lens=[40, 20, 20],
        num_kv_heads=heads,
        page_size=32,
        seed=3,
        dtype=dtype,
        cache_dtype=cache_dtype,
    )
    for kernel in _kernels(case):
        starts = set()
        for eqn in _kernel_eqns(kernel, "get"):
            shape = eqn.invars[0].aval.shape
            if len(shape) != 4 or shape[0] != 2 or shape[1] % 32 or shape[2:] != (2 * heads, 64):
                continue  # not a KV buffer: [2 slots, whole pages of 32 keys, 2Hkv, D]
            first, *views, last = jax.tree_util.tree_unflatten(eqn.params["tree"], eqn.invars[1:])
            assert [type(v).__name__ for v in views] == ["ReshapeTransform"] + ["BitcastTransform"] * (per_word > 1)
            rows, cols = last.indices
            assert isinstance(rows, pl.Slice) and rows.stride == 2 * heads // per_word, last
            assert cols.size == 64 and isinstance(first.indices[2], pl.Slice), first  # whole keys
            starts.add(rows.start)
        assert starts == {r // per_word for r in range(2 * heads)}  # K and V of every head
