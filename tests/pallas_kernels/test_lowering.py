"""Each kernel lowers for its real target from the CPU (no device, no compile).

`jit(f).trace(*shapes).lower(lowering_platforms=...)` runs the Pallas -> Triton (GPU) and
Pallas -> Mosaic (TPU) lowerings, which reject what the target cannot express (non power-of-two
Triton blocks, unsupported ops, bad memory spaces). A failure to lower fails the test. What it
cannot catch: ptxas, which runs only when compiling on a GPU; Mosaic's own passes run in
test_tpu_compile.py, which compiles for TPU chips without one.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType
from rpa_cases import operand_structs

from pallas_kernels import gpu, tpu
from pallas_kernels.gpu_config import is_decode_like

H100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
TPU_V5E = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
TPU_V6E = AbstractDevice(device_kind="TPU v6 lite", num_cores=1, platform="tpu")
TPU_7X = AbstractDevice(device_kind="TPU7x", num_cores=1, platform="tpu")


def _lower(kernel, operands, platform, device, **opts):
    args, scales = operands
    f = functools.partial(kernel, sm_scale=0.1, **opts)
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(f).trace(*args, **scales).lower(lowering_platforms=(platform,)).as_text()


SHAPES = {
    "bf16_d128": dict(),
    "f32_d64_gqa3": dict(dtype=jnp.float32, head_dim=64, q_heads=6),
    "f16_d256_gqa16": dict(dtype=jnp.float16, head_dim=256, q_heads=16, kv_heads=1),
    "bf16_d80_padded": dict(head_dim=80),
    "int8_kv": dict(cache_dtype=jnp.int8, page_size=32),
    "fp8_kv": dict(cache_dtype=jnp.float8_e4m3fn, page_size=32),
    "decode_batch": dict(tokens=256, seqs=256, pages_per_seq=64),
    "odd_sizes": dict(tokens=50, pages=37, seqs=5, pages_per_seq=9),
}
GPU_OPTIONS = {
    "plain": {},
    "window_cap": dict(sliding_window=128, soft_cap=30.0),
    "split_k": dict(config=gpu.GpuConfig(block_q=16, block_kv=128, num_splits=8)),
    "paths": dict(
        config=gpu.GpuPaths(
            gpu.GpuConfig(block_q=8, block_kv=128, num_splits=4), gpu.GpuConfig(block_q=16, block_kv=64, num_splits=1)
        )
    ),
}


@pytest.mark.parametrize("options", sorted(GPU_OPTIONS))
@pytest.mark.parametrize("shapes", sorted(SHAPES))
def test_gpu_kernel_lowers_for_cuda(shapes, options):
    text = _lower(
        gpu.ragged_paged_attention_gpu, operand_structs(**SHAPES[shapes]), "cuda", H100, **GPU_OPTIONS[options]
    )
    # One call under a GpuConfig or for a decode-like batch; else the decode split's two.
    shape = {"tokens": 64, "seqs": 8, **SHAPES[shapes]}
    config = GPU_OPTIONS[options].get("config")
    split = isinstance(config, gpu.GpuPaths) or (config is None and not is_decode_like(shape["tokens"], shape["seqs"]))
    assert text.count("__gpu$xla.gpu.triton") == (2 if split else 1)
    head_dim = SHAPES[shapes].get("head_dim", 128)
    cache_alias = "operand_index = 6,"  # the cache operand, written in place
    if head_dim & (head_dim - 1) == 0:  # the KV write is fused
        assert cache_alias in text
    else:  # padded head_dim: XLA scatters the K/V, the kernel only reads the cache
        assert "stablehlo.scatter" in text and cache_alias not in text
    # The split's second call stores its rows into the first call's output, in place; nothing
    # transposes the queries into blocks or the output back, and no loop (a GPU launches its
    # body's kernels once per turn) finds the work items' sequences.
    assert ("operand_index = 7," in text) == (split and not _splits(config, "rest"))
    assert "stablehlo.transpose" not in text and "stablehlo.while" not in text


def _splits(config, path):
    """Whether the decode split's `path` call of `config` (None: the default) has KV splits."""
    return config is not None and getattr(config, path).num_splits > 1


TPU_SHAPES = {k: v for k, v in SHAPES.items() if v.get("dtype") != jnp.float16 and v.get("head_dim", 128) % 64 == 0}
TPU_OPTIONS = {
    "plain": {},
    "window_cap": dict(sliding_window=128, soft_cap=30.0),
    "big_blocks": dict(config=tpu.TpuConfig(block_q=128, pages_per_block=16)),
    "small_paths": dict(config=tpu.TpuPaths(tpu.DecodeConfig(3, 1), tpu.TpuConfig(16, 2), tpu.TpuConfig(32, 4))),
}


# Every shape and option lowers for v5e; v6e and 7x with their own default blocks. The chip only
# enters through the blocks its VMEM fits (measured: these shapes lower to the same text for all
# three chips). Blocks past a chip's default VMEM limit are checked per chip by
# test_tpu_blocks_past_the_default_vmem_limit_ask_for_theirs; Mosaic's chip-specific passes run
# in test_tpu_compile.py.
TPU_CASES = [(shapes, options, "v5e") for shapes in sorted(TPU_SHAPES) for options in sorted(TPU_OPTIONS)] + [
    (shapes, "plain", chip) for shapes in sorted(TPU_SHAPES) for chip in ("v6e", "7x")
]
TPU_DEVICES = {"v5e": TPU_V5E, "v6e": TPU_V6E, "7x": TPU_7X}


@pytest.mark.parametrize(("shapes", "options", "chip"), TPU_CASES, ids=["-".join(c) for c in TPU_CASES])
def test_tpu_kernel_lowers_for_tpu(shapes, options, chip):
    text = _lower(
        tpu.ragged_paged_attention_tpu,
        operand_structs(**TPU_SHAPES[shapes]),
        "tpu",
        TPU_DEVICES[chip],
        **TPU_OPTIONS[options],
    )
    # The decode, mixed and prefill kernels; one ragged kernel under a single TpuConfig.
    calls = 1 if isinstance(TPU_OPTIONS[options].get("config"), tpu.TpuConfig) else 3
    assert text.count("@tpu_custom_call") == calls
    assert text.count("stablehlo.output_operand_alias") == calls  # every KV write is in place


@pytest.mark.parametrize("device,chip", [(TPU_V5E, "v5e"), (TPU_7X, "7x")], ids=["v5e", "7x"])
def test_tpu_blocks_past_the_default_vmem_limit_ask_for_theirs(device, chip):
    """f32 prefill, head_dim 256, 8 query heads per KV head: the default blocks need more than
    half of Mosaic's default 16 MiB, so the kernel's custom call carries the limit it asks for."""
    shape = dict(tokens=512, q_heads=8, kv_heads=1, head_dim=256, dtype=jnp.float32, seqs=2, pages_per_seq=64)
    config = tpu.default_paths(512, 2, 8, 1, 16, 64, 256, jnp.float32, chip=chip).prefill
    assert config.vmem_limit_bytes is not None
    text = _lower(tpu.ragged_paged_attention_tpu, operand_structs(**shape), "tpu", device)
    assert str(config.vmem_limit_bytes) in text


def test_lowering_check_has_teeth(monkeypatch):
    """With the kernel's padding of head_dim switched off, head_dim 48 (not a power of two) must
    be rejected by the Triton lowering itself: lowering here really runs Pallas -> Triton."""
    monkeypatch.setattr(gpu, "padded_head_dim", lambda d: d)
    with pytest.raises(ValueError, match="power of 2"):
        _lower(gpu.ragged_paged_attention_gpu, operand_structs(head_dim=48), "cuda", H100)
