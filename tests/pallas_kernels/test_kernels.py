"""Each Pallas kernel in interpret mode against the reference, on fresh random ragged batches.

GPU kernel: `interpret=True` (the generic Pallas interpreter). TPU kernel: the TPU interpreter
(`pltpu.InterpretParams`), which also simulates its DMAs and semaphores. Both the attention
output and the updated cache are compared; the cache holds NaN (or the int8 minimum) wherever no
sequence may read, so a kernel that reads an unwritten slot, or a write that lands in the wrong
slot, fails.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import common, gpu, tpu, tpu_layout
from pallas_kernels.reference import ragged_paged_attention_reference
import kernel_mode
from rpa_cases import make_case

TOL = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 3e-2}
# Compiled float32: full-precision dots, but the device's exp and reciprocal are approximate.
COMPILED_TOL = {jnp.dtype(jnp.float32): 1e-4, jnp.dtype(jnp.bfloat16): 3e-2}


def run_gpu(case, config=None, **opts):
    return gpu.ragged_paged_attention_gpu(*case.args(), **case.scales(), **opts, config=config,
                                          interpret=not kernel_mode.compiled("gpu"))


def run_tpu(case, config=None, interpret=None, **opts):
    if interpret is not None or kernel_mode.compiled("tpu"):
        return tpu.ragged_paged_attention_tpu(*case.args(), **case.scales(), **opts,
                                              config=config, interpret=interpret or False)
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):  # as a user would
        return tpu.ragged_paged_attention_tpu(*case.args(), **case.scales(), **opts, config=config)


KERNELS = {"gpu": run_gpu, "tpu": run_tpu}


@functools.lru_cache(maxsize=None)
def _reference(sm_scale, sliding_window, soft_cap):
    return jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=sm_scale,
                                     sliding_window=sliding_window, soft_cap=soft_cap))


def reference(case, sm_scale=0.125, sliding_window=None, soft_cap=None):
    with jax.default_matmul_precision("highest"):  # no TF32 in the oracle of a compiled kernel
        return _reference(sm_scale, sliding_window, soft_cap)(*case.args(), **case.scales())


def check(kernel, case, *, config=None, sm_scale=0.125, sliding_window=None, soft_cap=None):
    opts = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    compiled = kernel_mode.compiled(kernel)
    want_out, want_cache = reference(case, **opts)
    out, cache = KERNELS[kernel](case, config=config, **opts)
    out = np.asarray(jnp.asarray(out, jnp.float32))
    want_out = np.asarray(jnp.asarray(want_out, jnp.float32))
    assert out.shape == case.q.shape and not np.isnan(out).any()
    tol = (COMPILED_TOL if compiled else TOL)[jnp.dtype(case.q.dtype)]
    np.testing.assert_allclose(out, want_out, atol=tol, rtol=tol)
    num_real = int(case.cu_q_lens[int(case.num_seqs[0])])
    assert not out[num_real:].any(), "padding tokens must get zeros"
    np.testing.assert_array_equal(np.asarray(jnp.asarray(cache).astype(jnp.float32)),
                                  np.asarray(jnp.asarray(want_cache).astype(jnp.float32)))
    return out


BATCHES = {
    "decode": dict(q_lens=[1, 1, 1, 1, 1], kv_lens=[1, 17, 33, 64, 70]),
    "prefill": dict(q_lens=[7, 16, 33], kv_lens=[7, 16, 33]),
    "mixed": dict(q_lens=[5, 1, 20, 1, 9], kv_lens=[40, 30, 20, 1, 9]),
    "many_pages": dict(q_lens=[3, 1], kv_lens=[300, 129], page_size=8),
    "one_token_sequence": dict(q_lens=[1], kv_lens=[1]),
    "sequence_without_queries": dict(q_lens=[4, 0, 2], kv_lens=[10, 12, 2]),
    "no_sequences": dict(q_lens=[], kv_lens=[], pad_tokens=5),
    # Every row of the tables is a real sequence: nothing may read past the last.
    "no_padding_sequences": dict(q_lens=[1, 1, 1], kv_lens=[30, 1, 17], num_seqs_max=3, pad_tokens=0),
}
KERNEL_IDS = sorted(KERNELS)


@pytest.mark.parametrize("kernel", KERNEL_IDS)
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_batches(kernel, batch):
    check(kernel, make_case(**BATCHES[batch], seed=sorted(BATCHES).index(batch)))


@pytest.mark.parametrize("kernel", KERNEL_IDS)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_gqa_ratios(kernel, group):
    check(kernel, make_case(**BATCHES["mixed"], group=group, seed=group))


OPTIONS = {
    "sliding_window": dict(sliding_window=8),
    "soft_cap": dict(soft_cap=2.0, sm_scale=0.5),
    "window_and_cap": dict(sliding_window=21, soft_cap=3.0, sm_scale=0.3),
}


@pytest.mark.parametrize("kernel", KERNEL_IDS)
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_options(kernel, option):
    case = make_case(q_lens=[5, 1, 20, 3], kv_lens=[40, 30, 20, 77], page_size=8, seed=7)
    check(kernel, case, **OPTIONS[option])


DTYPES = {
    "bf16": dict(dtype=jnp.bfloat16),
    "int8_kv_f32": dict(dtype=jnp.float32, cache_dtype=jnp.int8),
    "int8_kv_bf16": dict(dtype=jnp.bfloat16, cache_dtype=jnp.int8),
    "fp8_kv_f32": dict(dtype=jnp.float32, cache_dtype=jnp.float8_e4m3fn),
    "fp8_kv_bf16": dict(dtype=jnp.bfloat16, cache_dtype=jnp.float8_e4m3fn),
}


@pytest.mark.parametrize("kernel", KERNEL_IDS)
@pytest.mark.parametrize("dtypes", sorted(DTYPES))
def test_dtypes(kernel, dtypes):
    case = make_case(q_lens=[5, 1, 20, 1], kv_lens=[40, 70, 20, 1], page_size=32, seed=3,
                     **DTYPES[dtypes])
    check(kernel, case, sliding_window=50)


@pytest.mark.parametrize("kernel", KERNEL_IDS)
@pytest.mark.parametrize("dtypes", ["bf16", "int8_kv_bf16"])
def test_many_kv_heads(kernel, dtypes):
    """Eight kv heads, each with its own cache scales where quantized: the TPU kernel reads each
    head's K and V rows out of whole-page buffers."""
    case = make_case(q_lens=[5, 1, 9], kv_lens=[40, 17, 9], num_kv_heads=8, group=1, page_size=32,
                     seed=21, **DTYPES[dtypes])
    check(kernel, case)


HEAD_DIMS = [("gpu", 80), ("gpu", 96), ("gpu", 128), ("gpu", 192), ("gpu", 256),
             ("tpu", 128), ("tpu", 256)]


@pytest.mark.parametrize(("kernel", "head_dim"), HEAD_DIMS)
def test_head_dims(kernel, head_dim):
    case = make_case(q_lens=[3, 1], kv_lens=[20, 41], head_dim=head_dim, num_kv_heads=1, group=4,
                     seed=head_dim)
    check(kernel, case, sm_scale=head_dim ** -0.5)


def test_gpu_head_dim_prefill_blocks():
    """head_dim 256 with a prefill-sized query block (64 rows) and a padded head_dim 80."""
    for head_dim in (80, 256):
        case = make_case(q_lens=[70, 2], kv_lens=[90, 50], head_dim=head_dim, num_kv_heads=1,
                         group=2, seed=head_dim + 1)
        check("gpu", case, sm_scale=head_dim ** -0.5)


def test_tpu_rejects_unaligned_head_dim():
    case = make_case(q_lens=[1], kv_lens=[4], head_dim=80)
    with pytest.raises(common.UnsupportedShape, match="head_dim=80"):
        run_tpu(case, sm_scale=0.1)


GPU_CONFIGS = {
    "split_k": gpu.GpuConfig(block_q=8, block_kv=16, num_splits=4),
    "split_k_more_splits_than_blocks": gpu.GpuConfig(block_q=8, block_kv=64, num_splits=8),
    "small_kv_blocks": gpu.GpuConfig(block_q=16, block_kv=16, num_splits=1),
}


def test_gpu_kv_blocks_smaller_than_a_page():
    case = make_case(q_lens=[40, 1, 7], kv_lens=[100, 65, 7], page_size=32, seed=12)
    check("gpu", case, config=gpu.GpuConfig(block_q=16, block_kv=16, num_splits=2))


@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_gpu_configs(name):
    case = make_case(q_lens=[5, 1, 20, 1], kv_lens=[40, 300, 20, 129], page_size=8, seed=11)
    check("gpu", case, config=GPU_CONFIGS[name], sliding_window=100 if "more" in name else None)


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
PATHS_BATCH = dict(q_lens=[1, 5, 1, 40, 1, 1, 20, 1, 3, 1, 33],
                   kv_lens=[70, 40, 1, 60, 17, 129, 20, 1, 3, 33, 50], page_size=8)


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
    source, dest = (np.asarray(x) for x in tpu_layout.token_maps(
        jnp.asarray(case.cu_q_lens), cu_ordered, order, num_tokens))
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
        for params in (pltpu.InterpretParams(detect_races=True),
                       pltpu.InterpretParams(dma_execution_mode="eager")):
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


def test_tpu_kernels_move_whole_pages_and_select_heads_in_vmem():
    """Every DMA of the TPU kernels (decode, mixed and prefill calls) moves whole keys (every kv
    head's K and V rows and every column: [n, 2Hkv, D], contiguous in HBM): a page of all heads
    in one copy, never a per-head slice of the tiled HBM cache; each head's K and V are taken
    from the VMEM buffers."""
    heads, page = 4, 8
    case = make_case(q_lens=[5, 1], kv_lens=[40, 20], num_kv_heads=heads, page_size=page, seed=3)
    jaxpr = jax.make_jaxpr(lambda *a: tpu.ragged_paged_attention_tpu(*a, sm_scale=0.1))(*case.args())
    kernels = [eqn.params["jaxpr"] for eqn in _kernel_eqns(jaxpr.jaxpr, "pallas_call")]
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
        heads_read = {int(i.val) for eqn in _kernel_eqns(kernel, "get")
                      if eqn.invars[0].aval.shape[-2:] == (2 * heads, 64)
                      for t in jax.tree_util.tree_unflatten(eqn.params["tree"], eqn.invars[1:])
                      for i in t.indices[-2:-1] if not isinstance(i, pl.Slice) and hasattr(i, "val")}
        assert heads_read == set(range(2 * heads))  # K and V of each head: a static row of the buffers


def test_poison_is_where_it_must_be():
    """Guards the tests themselves: new-token slots and unowned pages start as NaN."""
    case = make_case(q_lens=[3, 1], kv_lens=[10, 5], page_size=4, seed=0)
    page, slot = case.page_indices[0, 7 // 4], 7 % 4  # position 7 of sequence 0 is new
    assert np.isnan(case.kv_cache[page, slot]).all()
    assert np.isnan(case.kv_cache[0]).all()  # the null page
    assert not np.isnan(case.kv_cache[page, slot - 1]).any()  # position 6 is context


@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_default_configs(head_dim, dtype):
    """The default config of a decode batch and of a prefill chunk at this head_dim: lowers,
    compiles (within the device's shared memory, on a GPU) and matches the reference."""
    dtype = jnp.dtype(dtype)
    decode = make_case(q_lens=[1] * 6, kv_lens=[5, 40, 90, 130, 17, 64], head_dim=head_dim,
                       group=4, dtype=dtype, seed=head_dim)
    prefill = make_case(q_lens=[130, 3], kv_lens=[150, 3], head_dim=head_dim, group=4,
                        dtype=dtype, seed=head_dim + 1)
    for case in (decode, prefill):
        check("gpu", case, sm_scale=head_dim ** -0.5)


GEMMA_CASES = {  # (shape, options): Gemma 3 (1 KV head, 4 query heads) and Gemma 2 (soft cap)
    "gemma3": (dict(num_kv_heads=1, group=4), dict(sliding_window=24)),
    "gemma2": (dict(num_kv_heads=2, group=2), dict(sliding_window=24, soft_cap=1.0)),
}


@pytest.mark.parametrize("kernel", KERNEL_IDS)
@pytest.mark.parametrize("model", sorted(GEMMA_CASES))
def test_gemma_head_dim_256_with_sliding_window(kernel, model):
    """Gemma's attention: head_dim 256, scores scaled by 256^-1/2, a window shorter than most
    contexts (decode rows far past it, a prefill chunk that crosses its edge), Gemma 2's cap."""
    shape, opts = GEMMA_CASES[model]
    case = make_case(q_lens=[1, 1, 20, 5], kv_lens=[100, 30, 60, 25], head_dim=256, page_size=16,
                     seed=256 + len(opts), **shape)
    check(kernel, case, sm_scale=256 ** -0.5, **opts)
