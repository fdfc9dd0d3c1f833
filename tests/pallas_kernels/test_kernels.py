"""Each Pallas kernel in interpret mode against the reference, on fresh random ragged batches.

GPU kernel: `interpret=True` (the generic Pallas interpreter). TPU kernel: the TPU interpreter
(`pltpu.InterpretParams`), which also simulates its DMAs and semaphores. Both the attention
output and the updated cache are compared; the cache holds NaN (or the int8 minimum) wherever no
sequence may read, so a kernel that reads an unwritten slot, or a write that lands in the wrong
slot, fails. The TPU kernel's own cases (its paths, configs, DMAs) are in test_tpu_kernel.py.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from kernel_check import KERNELS, check
from rpa_cases import make_case

from pallas_kernels import gpu

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
    case = make_case(q_lens=[5, 1, 20, 1], kv_lens=[40, 70, 20, 1], page_size=32, seed=3, **DTYPES[dtypes])
    check(kernel, case, sliding_window=50)


@pytest.mark.parametrize("kernel", KERNEL_IDS)
@pytest.mark.parametrize("dtypes", ["bf16", "int8_kv_bf16"])
def test_many_kv_heads(kernel, dtypes):
    """Eight kv heads, each with its own cache scales where quantized: the TPU kernel reads each
    head's K and V rows out of whole-page buffers."""
    case = make_case(
        q_lens=[5, 1, 9], kv_lens=[40, 17, 9], num_kv_heads=8, group=1, page_size=32, seed=21, **DTYPES[dtypes]
    )
    check(kernel, case)


HEAD_DIMS = [("gpu", 80), ("gpu", 96), ("gpu", 128), ("gpu", 192), ("gpu", 256), ("tpu", 128), ("tpu", 256)]


@pytest.mark.parametrize(("kernel", "head_dim"), HEAD_DIMS)
def test_head_dims(kernel, head_dim):
    case = make_case(q_lens=[3, 1], kv_lens=[20, 41], head_dim=head_dim, num_kv_heads=1, group=4, seed=head_dim)
    check(kernel, case, sm_scale=head_dim**-0.5)


def test_gpu_head_dim_prefill_blocks():
    """head_dim 256 with a prefill-sized query block (64 rows) and a padded head_dim 80."""
    for head_dim in (80, 256):
        case = make_case(
            q_lens=[70, 2], kv_lens=[90, 50], head_dim=head_dim, num_kv_heads=1, group=2, seed=head_dim + 1
        )
        check("gpu", case, sm_scale=head_dim**-0.5)


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


PATHS = {  # the decode split with explicit blocks: decode call with split-K, the rest small
    "mixed": dict(q_lens=[5, 1, 20, 1, 9, 1], kv_lens=[40, 300, 20, 1, 9, 129]),
    "decode_tokens_only": dict(q_lens=[1, 1, 1], kv_lens=[30, 1, 17], pad_tokens=9),
    "no_decode_tokens": dict(q_lens=[5, 2, 9], kv_lens=[40, 2, 70]),
}


SPLIT_PATHS = {  # which of the two calls merges KV splits (the other stores its rows)
    "decode_split_k": gpu.GpuPaths(
        decode=gpu.GpuConfig(block_q=8, block_kv=16, num_splits=4),
        rest=gpu.GpuConfig(block_q=16, block_kv=32, num_splits=1),
    ),
    "rest_split_k": gpu.GpuPaths(
        decode=gpu.GpuConfig(block_q=8, block_kv=16, num_splits=1),
        rest=gpu.GpuConfig(block_q=8, block_kv=16, num_splits=2),
    ),
}


@pytest.mark.parametrize("paths", sorted(SPLIT_PATHS))
@pytest.mark.parametrize("batch", sorted(PATHS))
def test_gpu_decode_split(batch, paths):
    """GpuPaths: the sequences with one query token in a call of their own, every other one in
    the second, which stores its rows into the first call's output; each call writes only its
    own sequences' slots, and the poisoned cache shows a read of anyone else's. A prefill-like
    batch takes this split by default (test_batches)."""
    case = make_case(**PATHS[batch], page_size=8, seed=13)
    check("gpu", case, config=SPLIT_PATHS[paths], sliding_window=100)


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
    decode = make_case(
        q_lens=[1] * 6, kv_lens=[5, 40, 90, 130, 17, 64], head_dim=head_dim, group=4, dtype=dtype, seed=head_dim
    )
    prefill = make_case(q_lens=[130, 3], kv_lens=[150, 3], head_dim=head_dim, group=4, dtype=dtype, seed=head_dim + 1)
    for case in (decode, prefill):
        check("gpu", case, sm_scale=head_dim**-0.5)


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
    case = make_case(
        q_lens=[1, 1, 20, 5], kv_lens=[100, 30, 60, 25], head_dim=256, page_size=16, seed=256 + len(opts), **shape
    )
    check(kernel, case, sm_scale=256**-0.5, **opts)
