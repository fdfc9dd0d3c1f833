"""The GPU kernel's block sizes fit the device's shared memory for every head_dim it takes."""

import itertools

import jax.numpy as jnp
import pytest

from pallas_kernels import common, gpu_tuned
from pallas_kernels.gpu_config import (
    GpuConfig,
    GpuPaths,
    check_config,
    default_config,
    default_paths,
    device_limits,
    smem_bytes,
)

HEAD_DIMS = [64, 80, 96, 128, 192, 256]
DEVICES = ["NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB", "NVIDIA L4"]
# (num_tokens, num_seqs, pages_per_seq): decode at short and long context, a prefill chunk, mixed
BATCHES = [(64, 64, 64), (1, 1, 2048), (2048, 1, 256), (2112, 65, 256)]


def test_footprint_matches_what_triton_reported():
    """On an H100, Triton asked for 348,224 bytes for this config (f32, head_dim 256)."""
    assert smem_bytes(GpuConfig(block_q=4, block_kv=64, num_splits=1), 4, 256, jnp.float32) == 348224


def test_known_devices():
    assert device_limits("NVIDIA H100 80GB HBM3") == (232448, 132)
    assert device_limits("NVIDIA A100-SXM4-40GB")[0] == 166912
    assert device_limits("Some Future GPU")[0] <= 166912  # unknown: the smallest budget


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_default_config_fits(device, head_dim, dtype):
    budget, _ = device_limits(device)
    for (tokens, seqs, pages), group in itertools.product(BATCHES, [1, 4, 8]):
        config = default_config(tokens, seqs, group, 8, head_dim, 16, pages, dtype, device)
        gp = common.next_pow2(group)
        check_config(config, gp)
        used = smem_bytes(config, gp, head_dim, dtype)
        assert used <= budget, f"{config} needs {used} B of shared memory; {device} has {budget}"


def test_budget_shrinks_only_what_it_must():
    h100 = "NVIDIA H100 80GB HBM3"
    small = default_config(64, 64, 4, 8, 128, 16, 64, jnp.bfloat16, h100)
    assert (small.block_kv, small.num_stages) == (128, 1)  # 128-dim bf16 decode fits as is
    big = default_config(2048, 1, 4, 8, 256, 16, 256, jnp.float32, h100)  # f32 prefill, D=256
    assert (big.block_q * 4, big.block_kv, big.num_stages) == (64, 32, 1)


def test_tuned_table_is_valid_and_fits():
    """Every shipped entry lowers and fits its device's shared memory."""
    entries = gpu_tuned.load()
    assert entries, "the package ships a tuned table"
    for e in entries:
        config = GpuConfig(**e["config"])
        gp = common.next_pow2(e["group"])
        check_config(config, gp)
        assert smem_bytes(config, gp, e["head_dim"], e["dtype"]) <= device_limits(e["device"])[0]


def test_default_config_takes_the_nearest_tuned_entry(tmp_path, monkeypatch):
    table = tmp_path / "tuned.json"
    entry = {
        "device": "NVIDIA H100 80GB HBM3",
        "head_dim": 128,
        "group": 4,
        "page_size": 16,
        "dtype": "bfloat16",
        "mode": "decode",
        "num_seqs": 64,
        "max_kv": 1024,
        "config": {"block_q": 4, "block_kv": 64, "num_splits": 2, "num_warps": 8, "num_stages": 1},
    }
    gpu_tuned.merge([entry], str(table))
    gpu_tuned.merge([{**entry, "num_seqs": 256}], str(table))  # a second shape
    gpu_tuned.merge([{**entry, "config": {**entry["config"], "num_splits": 4}}], str(table))  # replaces
    assert len(gpu_tuned.load(str(table))) == 2
    monkeypatch.setattr(gpu_tuned, "TABLE", table)
    h100 = "NVIDIA H100 80GB HBM3"
    near = default_config(96, 96, 4, 8, 128, 16, 80, jnp.bfloat16, h100)  # 96 seqs, 1280 keys
    assert (near.block_kv, near.num_splits, near.num_warps) == (64, 4, 8)
    for other in (
        default_config(96, 96, 4, 8, 128, 16, 80, jnp.float32, h100),  # dtype differs
        default_config(1, 1, 4, 8, 128, 16, 80, jnp.bfloat16, h100),  # 96x fewer seqs
        default_config(96, 96, 4, 8, 128, 16, 80, jnp.bfloat16, "NVIDIA A100-SXM4-80GB"),
    ):
        assert (other.block_kv, other.num_warps) != (64, 8)
    assert gpu_tuned.lookup(h100, 128, 4, 16, "bfloat16", "prefill", 96, 1280, str(table)) is None
    # An entry reaches 2x its sequence count, 4x its context: the 64-sequence entry alone does
    # not set 256 sequences' splits and warps, but does set 64 sequences' at 4k keys.
    alone = tmp_path / "alone.json"
    gpu_tuned.merge([entry], str(alone))
    assert gpu_tuned.lookup(h100, 128, 4, 16, "bfloat16", "decode", 256, 1024, str(alone)) is None
    assert gpu_tuned.lookup(h100, 128, 4, 16, "bfloat16", "decode", 128, 1024, str(alone))
    assert gpu_tuned.lookup(h100, 128, 4, 16, "bfloat16", "decode", 64, 4096, str(alone))


def test_a_prefill_like_batch_runs_its_decode_tokens_with_the_decode_blocks():
    """default_paths: one call for a decode-like batch; otherwise the decode split, whose decode
    call has the decode blocks of min(T, S) sequences (16-row query blocks, one stage, KV splits
    for few sequences) and whose other call keeps the batch's own config. Both fit."""
    h100 = "NVIDIA H100 80GB HBM3"
    shape = (4, 8, 128, 16, 256, jnp.bfloat16, h100)
    decode_like = default_paths(64, 64, *shape)
    assert decode_like == default_config(64, 64, *shape)
    paths = default_paths(2112, 65, *shape)
    assert isinstance(paths, GpuPaths)
    assert paths.rest == default_config(2112, 65, *shape)
    assert paths.decode == default_config(65, 65, *shape)
    assert (paths.decode.block_q * 4, paths.decode.num_stages) == (16, 1)
    assert paths.rest.block_q * 4 == 128 and paths.rest.num_stages == 2
    assert default_paths(2048, 1, *shape).decode.num_splits > 1  # one decode sequence: split-K
    for config in (paths.decode, paths.rest):
        assert smem_bytes(config, 4, 128, jnp.bfloat16) <= device_limits(h100)[0]
    check_config(paths, 4)
    with pytest.raises(common.UnsupportedShape):
        check_config(GpuPaths(GpuConfig(2, 64, 1), paths.rest), 4)  # 8 decode rows: too few


def test_one_long_sequence_gets_more_kv_splits():
    """A lone decode sequence is split over the SMs: 16 splits at 4k context (2 blocks of 128
    each), 32 from 16k (the H200's fastest at each, measured 2026-11-29); short ones keep at
    least one block per split."""
    h200 = "NVIDIA H200"

    def splits(context: int) -> int:
        return default_config(1, 1, 4, 8, 128, 16, context // 16, jnp.bfloat16, h200).num_splits

    assert [splits(c) for c in (512, 1024, 4096, 16384, 65536)] == [4, 8, 16, 32, 32]
