"""The TPU kernel's block sizes fit the target chip's VMEM (pallas_kernels/tpu_blocks.py), and what the
kernels take (pallas_kernels/tpu_config.py)."""

import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from pallas_kernels import tpu_blocks as tb
from pallas_kernels import tpu_config as tc

CHIPS = ["v4", "v5e", "v5p", "v6e", "7x"]
DTYPES = [(jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.float32), (jnp.bfloat16, jnp.int8)]
# (num_tokens, num_seqs, group, num_kv_heads, page_size, pages_per_seq): decode, prefill, wide
# groups, long pages, many kv heads
SHAPES = [
    (256, 256, 4, 8, 16, 64),
    (2048, 4, 4, 8, 16, 256),
    (512, 2, 16, 2, 16, 128),
    (64, 64, 1, 16, 32, 512),
    (4096, 1, 8, 4, 64, 64),
    (1024, 8, 2, 16, 16, 128),
]


@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype,cache_dtype", DTYPES, ids=["bf16", "f32", "int8kv"])
def test_every_default_config_fits_the_chip(chip, head_dim, dtype, cache_dtype):
    """The single ragged call's blocks, and each of the three paths' (separate kernels) alone."""
    capacity = tb.vmem_capacity(chip)
    for tokens, seqs, group, kv_heads, page_size, pages_per_seq in SHAPES:
        shape = (tokens, seqs, group, kv_heads, page_size, pages_per_seq, head_dim, dtype, cache_dtype)
        paths = tb.default_paths(*shape, chip=chip)
        tc.check_config(paths)
        assert paths.mixed.block_q == 16 and paths.prefill.block_q >= 16
        for config in (tb.default_config(*shape, chip=chip), paths.decode, paths.mixed, paths.prefill):
            tc.check_config(config)
            need = tb.vmem_bytes(config, group, kv_heads, page_size, head_dim, dtype, cache_dtype)
            assert need <= capacity * 3 // 8, (config, need)
            if config.vmem_limit_bytes is None:  # Mosaic's default limit holds it twice over
                assert 2 * need <= tb.DEFAULT_SCOPED_VMEM, (config, need)
            else:
                assert 2 * need <= config.vmem_limit_bytes <= capacity * 3 // 4, (config, need)


def test_decode_blocks_take_long_kv_steps_and_shrink_to_fit():
    """bf16, 8 KV heads of 128: a decode step takes 2048 positions (128 pages of 16) where
    VMEM allows; with 16 KV heads of 256 in float32 on v4 it takes fewer, then fewer sequences."""
    roomy = tb.default_paths(256, 256, 4, 8, 16, 256, 128, jnp.bfloat16, chip="v6e").decode
    assert (roomy.seqs_per_block, roomy.pages_per_block) == (8, 128)
    tight = tb.default_paths(256, 256, 4, 16, 16, 256, 256, jnp.float32, chip="v4").decode
    assert tight.pages_per_block < 128
    assert tb.vmem_bytes(tight, 4, 16, 16, 256, jnp.float32, jnp.float32) <= tb.vmem_capacity("v4") * 3 // 8
    one_seq = tb.default_paths(1, 1, 4, 8, 16, 256, 128, jnp.bfloat16, chip="v6e").decode
    assert one_seq.seqs_per_block == 1  # never more sequences per step than the batch holds


def test_vmem_bytes_counts_whole_sublane_tiles():
    """One bf16 KV head: [N, 2, D] key buffers take 16 rows per key in VMEM, not 2."""
    config = tc.TpuConfig(block_q=16, pages_per_block=4)
    one = tb.vmem_bytes(config, 4, 1, 16, 128, jnp.bfloat16, jnp.bfloat16)
    eight = tb.vmem_bytes(config, 4, 8, 16, 128, jnp.bfloat16, jnp.bfloat16)
    buffers = tc.KV_SCRATCH_BUFFERS * 2 * 64 * 16 * 128 * 2  # padded rows: the same for 1..8 heads
    assert one >= buffers and eight - one == 7 * (2 * 2 * 64 * 128 * 2 + 64 * (128 + 256) * 4)


def test_capacities_come_from_jax_table():
    mib = {chip: tb.vmem_capacity(chip) >> 20 for chip in CHIPS}
    assert mib == {"v4": 16, "v5e": 128, "v5p": 64, "v6e": 128, "7x": 64}


def test_a_config_too_big_for_the_chip_shrinks_kv_step_first():
    """f32, head_dim 256, 16 query heads per KV head, one KV head: the shape's blocks need ~10
    MiB, over 3/8 of v4's 16 MiB; the KV step halves until they fit, and the query block stays."""
    args = dict(group=16, num_kv_heads=1, page_size=16, head_dim=256, dtype=jnp.float32, cache_dtype=jnp.float32)
    shaped = tb._shape_config(2048, 4, 16, 16, 256)
    assert tb.vmem_bytes(shaped, **args) > tb.vmem_capacity("v4") * 3 // 8
    fitted = tb.default_config(2048, 4, 16, 1, 16, 256, 256, jnp.float32, chip="v4")
    assert fitted.block_q == shaped.block_q and fitted.pages_per_block < shaped.pages_per_block
    assert tb.vmem_bytes(fitted, **args) <= tb.vmem_capacity("v4") * 3 // 8
    on_v6e = tb.default_config(2048, 4, 16, 1, 16, 256, 256, jnp.float32, chip="v6e")
    assert on_v6e.pages_per_block == shaped.pages_per_block and on_v6e.vmem_limit_bytes is not None


def test_vmem_bytes_counts_the_kernels_scratch():
    config = tc.TpuConfig(block_q=32, pages_per_block=4)
    kv_heads = 4
    scratch = 2 * 2 * (4 * 16 * 2 * kv_heads) * 128 * 2  # two [2, N * 2Hkv, D] bf16 row buffers
    assert tc.KV_SCRATCH_BUFFERS * math.prod(tc.kv_scratch_shape(config, 16, kv_heads, 128)) * 2 == scratch
    blocks = 2 * 2 * kv_heads * (8 * 32) * 128 * 2  # q and out [Hkv, M, D], double-buffered
    state = kv_heads * (8 * 32) * (128 + 2 * 128) * 4  # acc, and m and l padded to 128 lanes
    assert tb.vmem_bytes(config, 8, kv_heads, 16, 128, jnp.bfloat16, jnp.bfloat16) > scratch + blocks + state
    # Every kv head's blocks live at once: the need grows with the head count.
    assert (
        tb.vmem_bytes(config, 8, 2 * kv_heads, 16, 128, jnp.bfloat16, jnp.bfloat16)
        > tb.vmem_bytes(config, 8, kv_heads, 16, 128, jnp.bfloat16, jnp.bfloat16) + scratch + blocks
    )


@pytest.mark.parametrize(
    "kind,chip", [("TPU v5 lite", "v5e"), ("TPU v6 lite", "v6e"), ("TPU7x", "7x"), ("TPU v5p", "v5p"), ("TPU v4", "v4")]
)
def test_the_target_chip_is_the_abstract_meshs_when_lowering_from_elsewhere(kind, chip):
    mesh = AbstractMesh(
        (1,),
        ("x",),
        (AxisType.Explicit,),
        abstract_device=AbstractDevice(device_kind=kind, num_cores=1, platform="tpu"),
    )
    with jax.sharding.use_abstract_mesh(mesh):
        assert tb.target_chip() == chip
    if jax.default_backend() != "tpu":
        assert tb.target_chip() == "v5e"


def _table_operands(seqs: int, pages_per_seq: int):
    sd = jax.ShapeDtypeStruct
    return (sd((seqs, 8, 128), jnp.bfloat16), sd((64, 16, 4, 128), jnp.bfloat16), sd((seqs, pages_per_seq), jnp.int32))


def test_a_page_table_past_smem_is_refused_by_its_size():
    """The kernels scalar-prefetch the page table into SMEM (1 MiB; Mosaic refuses 2 MiB:
    test_tpu_compile.py): half of it is the most a table may take, and the refusal names it."""
    assert tc.unsupported_reason(*_table_operands(256, 512)) is None  # 512 KiB: compiles for v5e
    reason = tc.unsupported_reason(*_table_operands(256, 2048))
    assert "256 x 2048 pages" in reason and "2048 KiB" in reason and "SMEM" in reason


def test_an_explicit_tpu_kernel_raises_on_a_table_past_smem():
    from pallas_kernels import dispatch

    q, cache, table = (jnp.zeros(a.shape, a.dtype) for a in _table_operands(64, 4096))
    kv = jnp.zeros((64, 2, 128), jnp.bfloat16)
    args = (
        q,
        kv,
        kv,
        cache,
        jnp.ones(64, jnp.int32),
        table,
        jnp.arange(65, dtype=jnp.int32),
        jnp.array([64], jnp.int32),
    )
    with pytest.raises(ValueError, match=r"64 x 4096 pages \(1024 KiB"):
        dispatch.ragged_paged_attention(*args, sm_scale=0.1, impl="pallas_tpu")


@pytest.mark.parametrize(
    "seqs,max_len,least,page",
    [
        (64, 8192, 16, 16),  # 64 x 512 pages: 128 KiB
        (64, 131072, 16, 64),  # Llama 3's context at the default 64 sequences: 64 x 2048 = 512 KiB
        (256, 131072, 16, 256),  # 256 x 512
        (256, 8192, 32, 32),  # one-byte caches take pages of 32 tokens at least
        (1, 1 << 40, 16, 1024),  # never past 1024 tokens a page, fit or not
    ],
)
def test_table_page_size_is_the_smallest_power_of_two_that_fits(seqs, max_len, least, page):
    assert tc.table_page_size(seqs, max_len, least) == page
    if page < tc.MAX_TABLE_PAGE_SIZE:
        assert seqs * -(-max_len // page) * 4 <= tc.PAGE_TABLE_SMEM_BYTES
    if page > least:
        assert seqs * -(-max_len // (page // 2)) * 4 > tc.PAGE_TABLE_SMEM_BYTES


def test_the_engine_picks_its_page_size_for_the_tpu_kernel():
    """EngineConfig.page_size None: 16 on the reference (this CPU); with the TPU kernel, pages
    whose table fits SMEM (32 tokens at least for int8 caches); a given size is kept as is."""
    from jaxinfer.config import EngineConfig

    assert EngineConfig().with_page_size(131072).cache.page_size == 16
    assert EngineConfig(attn_impl="pallas_tpu").with_page_size(131072).cache.page_size == 64
    assert EngineConfig(attn_impl="pallas_tpu", max_num_seqs=256).with_page_size(8192).cache.page_size == 16
    assert EngineConfig(attn_impl="pallas_tpu", kv_cache_dtype="int8").with_page_size(2048).cache.page_size == 32
    assert EngineConfig(attn_impl="pallas_tpu", page_size=16).with_page_size(131072).cache.page_size == 16


def test_the_engine_runs_on_the_page_size_it_chose():
    """Pool, runner, cache and page table all take the chosen size (no step is compiled)."""
    from pathlib import Path

    from jaxinfer.config import EngineConfig, ModelConfig
    from jaxinfer.engine import Engine
    from jaxinfer.loader import LoadedModel
    from jaxinfer.models.registry import get_family

    config = ModelConfig(
        model_type="llama",
        family="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=8192,
    )
    family = get_family("llama")
    model = LoadedModel(config, family.init_params(config, jax.random.key(0)), None, family, Path("random"))
    engine = Engine(
        model,
        EngineConfig(attn_impl="pallas_tpu", num_pages=8, max_num_seqs=512, compilation_cache_dir=None),
        warm_up=False,
    )
    assert engine.config.cache.page_size == engine.kv_cache.page_size == engine.worker.step.engine.cache.page_size == 32
    assert engine.worker.state.pages_per_seq == 256 and engine.worker.state.kv_caches[0].shape[1] == 32
