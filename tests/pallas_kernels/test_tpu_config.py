"""The TPU kernel's block sizes fit the target chip's VMEM (pallas_kernels/tpu_config.py)."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from pallas_kernels import tpu_config as tc

CHIPS = ["v4", "v5e", "v5p", "v6e", "7x"]
DTYPES = [(jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.float32), (jnp.bfloat16, jnp.int8)]
# (num_tokens, num_seqs, group, page_size, pages_per_seq): decode, prefill, wide groups, long pages
SHAPES = [(256, 256, 4, 16, 64), (2048, 4, 4, 16, 256), (512, 2, 16, 16, 128), (64, 64, 1, 32, 512),
          (4096, 1, 8, 64, 64)]


@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype,cache_dtype", DTYPES, ids=["bf16", "f32", "int8kv"])
def test_every_default_config_fits_the_chip(chip, head_dim, dtype, cache_dtype):
    capacity = tc.vmem_capacity(chip)
    for tokens, seqs, group, page_size, pages_per_seq in SHAPES:
        config = tc.default_config(tokens, seqs, group, page_size, pages_per_seq, head_dim, dtype,
                                   cache_dtype, chip=chip)
        tc.check_config(config)
        need = tc.vmem_bytes(config, group, page_size, head_dim, dtype, cache_dtype)
        assert need <= capacity // 2, (config, need)
        if config.vmem_limit_bytes is None:  # Mosaic's default limit holds it twice over
            assert 2 * need <= tc.DEFAULT_SCOPED_VMEM, (config, need)
        else:
            assert 2 * need <= config.vmem_limit_bytes <= capacity * 3 // 4, (config, need)


def test_capacities_come_from_jax_table():
    mib = {chip: tc.vmem_capacity(chip) >> 20 for chip in CHIPS}
    assert mib == {"v4": 16, "v5e": 128, "v5p": 64, "v6e": 128, "7x": 64}


def test_a_config_too_big_for_the_chip_shrinks_kv_step_first():
    """f32, head_dim 256, 16 query heads per KV head: the shape's blocks need ~9 MiB, over half
    of v4's 16 MiB; the KV step halves until they fit, and the query block stays."""
    args = dict(group=16, page_size=16, head_dim=256, dtype=jnp.float32, cache_dtype=jnp.float32)
    shaped = tc._shape_config(2048, 4, 16, 16, 256)
    assert tc.vmem_bytes(shaped, **args) > tc.vmem_capacity("v4") // 2
    fitted = tc.default_config(2048, 4, 16, 16, 256, 256, jnp.float32, chip="v4")
    assert fitted.block_q == shaped.block_q and fitted.pages_per_block < shaped.pages_per_block
    assert tc.vmem_bytes(fitted, **args) <= tc.vmem_capacity("v4") // 2
    on_v6e = tc.default_config(2048, 4, 16, 16, 256, 256, jnp.float32, chip="v6e")
    assert on_v6e.pages_per_block == shaped.pages_per_block and on_v6e.vmem_limit_bytes is not None


def test_vmem_bytes_counts_the_kernels_scratch():
    config = tc.TpuConfig(block_q=32, pages_per_block=4)
    scratch = tc.KV_SCRATCH_BUFFERS * 2 * (4 * 16) * 128 * 2  # [2, N, D] bf16, four of them
    blocks = 2 * 2 * (8 * 32) * 128 * 2  # q and out [M, D], double-buffered
    assert tc.vmem_bytes(config, 8, 16, 128, jnp.bfloat16, jnp.bfloat16) > scratch + blocks


@pytest.mark.parametrize("kind,chip", [("TPU v5 lite", "v5e"), ("TPU v6 lite", "v6e"), ("TPU7x", "7x"),
                                       ("TPU v5p", "v5p"), ("TPU v4", "v4")])
def test_the_target_chip_is_the_abstract_meshs_when_lowering_from_elsewhere(kind, chip):
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,),
                        abstract_device=AbstractDevice(device_kind=kind, num_cores=1, platform="tpu"))
    with jax.sharding.use_abstract_mesh(mesh):
        assert tc.target_chip() == chip
    if jax.default_backend() != "tpu":
        assert tc.target_chip() == "v5e"
