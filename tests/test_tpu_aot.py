"""The engine's whole step compiled for TPU slices on this machine (benchmarks/tpu_aot.py):
parameters of a real shape by the model's logical axes, the paged cache as large as the chip's
HBM allows, the inputs, the sampler and the Pallas TPU kernel, through XLA:TPU's compiler with
libtpu's deviceless topologies. Skips, saying so, where libtpu is not in .venv/tpu-compiler."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from xla_env import TPU_COMPILER, has_tpu_compiler, tpu_compiler_env

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    not has_tpu_compiler(), reason=f"libtpu not installed in {TPU_COMPILER} (tools/install.sh --test)"
)


def aot(*args: str) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tpu_aot.py"), *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=tpu_compiler_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def tensor4_on_v5e():
    """Two layers of the Llama-3.1-8B shape (head_dim 128) over a v5e 2x2 slice, tensor=4."""
    return aot(
        "--shape",
        "llama-3.1-8b",
        "--num-layers",
        "2",
        "--topology",
        "v5e:2x2",
        "--mesh",
        "tensor=4",
        "--buckets",
        "8",
        "--max-num-batched-tokens",
        "8",
        "--max-num-seqs",
        "32",
        "--max-model-len",
        "8192",
    )


def test_every_step_variant_compiles_for_a_tpu_slice(tensor4_on_v5e):
    summary, *variants = tensor4_on_v5e
    assert summary["chip"] == "v5e" and summary["devices"] == 4 and summary["page_size"] == 16
    # The 8-token step and, the bucket being decode-sized (at most max_num_seqs), its window of 8.
    assert [(v["bucket"], v["num_steps"]) for v in variants] == [(8, 1), (8, 8)]
    for v in variants:
        assert "error" not in v, v
        assert v["tpu_custom_calls"] == 6, v  # the decode, mixed and prefill kernels per layer
        # The fused q|k|v and gate|up weights are read in their pinned layout: without it XLA
        # relays each before its matmul on every step (sharding/weight_layout.py).
        assert v["weight_copies"] == {}, v


def test_the_step_fits_the_chips_hbm_with_the_cache_in_place(tensor4_on_v5e):
    """The KV pool takes 0.85 of what the weights leave; the cache is donated and written in
    place (no copy of a layer's cache), so the temporaries stay small beside it."""
    summary, *variants = tensor4_on_v5e
    for v in variants:
        assert v["cache_copies"] == 0, v
        assert v["argument_gib"] + v["temp_gib"] < v["hbm_gib"], v
        assert v["temp_gib"] < 0.1 * summary["kv_gib_per_chip"], v


@pytest.mark.parametrize(
    "topology,mesh,kv_cache_dtype,itemsize,rows",
    [
        # two replicas: the step vmapped over [data], and its variant that scores prompt rows
        ("v5e:2x2", "data=2,tensor=2", "auto", 2, 8),
        ("v5e:1x1", "tensor=1", "int8", 1, 16),  # and the split step's forward (no split with replicas)
    ],
)
def test_a_head_dim_64_step_keeps_its_cache_in_place(topology, mesh, kv_cache_dtype, itemsize, rows):
    """head_dim 64 (Llama-3.2-1B): XLA:TPU's own layout for a [P, page, 2Hkv, 64] cache puts a
    major axis minor, which would relay every layer's cache around the kernels twice a step. The
    engine pins the cache row-major (pallas_kernels.kv_layout) and plans its pool in the padded
    bytes that layout takes (64 of 128 lanes used), so the step fits the chip with no copy: with
    data replicas (a [data, P, page, 2Hkv, D] cache), and with an int8 cache and its scales."""
    summary, *variants = aot(
        "--shape",
        "llama-3.2-1b",
        "--num-layers",
        "2",
        "--topology",
        topology,
        "--mesh",
        mesh,
        "--buckets",
        "8",
        "--max-num-batched-tokens",
        "8",
        "--max-model-len",
        "8192",
        "--decode-steps",
        "1",
        "--kv-cache-dtype",
        kv_cache_dtype,
        "--split",
        *(["--prompt-logprobs"] if "data" in mesh else []),
    )  # one compile each: CI time
    assert summary["kv_dtype"] == {"auto": "bfloat16", "int8": "int8"}[kv_cache_dtype]
    assert [(v.get("split", False), v.get("prompt", False)) for v in variants] == (
        [(False, False), (False, True)] if "data" in mesh else [(False, False), (True, False)]
    )
    for step in variants:
        assert step["bucket"] == 8 and step["num_steps"] == 1 and "error" not in step, step
        assert step["tpu_custom_calls"] == 6, step
        assert step["cache_copies"] == 0, step
        # With data replicas (the step vmapped) XLA used to relay q|k|v to a transposed layout
        # for a transposed product, every layer, every step; its output is pinned row-major now.
        assert step["weight_copies"] == {}, step
        assert step["argument_gib"] + step["temp_gib"] < step["hbm_gib"], step
    # one chip's 2 layers of [P, page, rows = its 2Hkv, D=64], each 64-wide row padded to 128 lanes
    logical = 2 * summary["num_pages"] * summary["page_size"] * rows * 64 * itemsize
    assert summary["kv_gib_per_chip"] == pytest.approx(2 * logical / 2**30, abs=1e-3)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_a_mixture_of_experts_compiles_as_a_tpu_runs_it_over_data_replicas(quantization):
    """The SmolLM2-shaped mixture over 4 data replicas: the TPU's form of the experts (grouped
    matmuls, `lax.ragged_dot`, which cannot be vmapped over shared weights: the replicas' tokens
    run as rows of one call), the experts read in their placed layout (no weight relaid into
    another shape either; int8 experts go into the grouped matmuls as integers, not converted
    to floats in memory first), and 3 kv heads (6 rows a token: the kernels read them row by
    row)."""
    summary, step = aot(
        "--shape",
        "smollm2-moe",
        "--num-layers",
        "2",
        "--topology",
        "v5e:2x2",
        "--mesh",
        "data=4",
        "--buckets",
        "8",
        "--max-num-batched-tokens",
        "8",
        "--max-model-len",
        "2048",
        "--decode-steps",
        "1",
        *(["--quantization", quantization] if quantization else []),
    )
    assert summary["mesh"]["data"] == 4
    assert "error" not in step, step
    assert step["tpu_custom_calls"] > 6, step  # the attention kernels and the grouped matmuls'
    assert step["weight_copies"] == {} and step["cache_copies"] == 0, step


def test_quantized_weights_compile_and_leave_more_of_the_chip_to_the_cache():
    """--quantization gives the linear weights a quantized load's structure: int8 per channel
    compiles for the slice with no weight relaid, and its pool is larger than with bf16."""
    common = (
        "--shape",
        "llama-3.1-8b",
        "--num-layers",
        "2",
        "--topology",
        "v5e:2x2",
        "--mesh",
        "tensor=4",
        "--buckets",
        "8",
        "--max-num-batched-tokens",
        "8",
        "--max-model-len",
        "8192",
        "--decode-steps",
        "1",
    )
    summary, step = aot(*common, "--quantization", "int8")
    assert summary["quantization"] == "int8" and "error" not in step, step
    assert step["weight_copies"] == {} and step["cache_copies"] == 0, step
    assert step["tpu_custom_calls"] == 6, step
    linear = 2 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336)  # 2 layers' q|k|v, o, gate|up, down
    embeddings = 2 * 4096 * 128256  # the embedding and the untied LM head stay bf16
    per_chip = lambda linear_bytes: (linear * linear_bytes + embeddings * 2) / 4 / 2**30  # noqa: E731
    assert summary["param_gib_per_chip"] == pytest.approx(per_chip(1), abs=0.005), summary  # + the scales
    assert per_chip(2) - summary["param_gib_per_chip"] > 0.09, summary


PADDING = """
import json, jax.numpy as jnp
from jax.experimental import topologies
from pallas_kernels.kv_layout import layout_bytes
device = topologies.get_topology_desc("v5e:1x1", "tpu").devices[0]
def ratio(dtype, rows, d):
    return layout_bytes((3, 16, rows, d), dtype, device) / (3 * 16 * rows * d * jnp.dtype(dtype).itemsize)
print(json.dumps({f"{dtype} {rows}x{d}": ratio(dtype, rows, d)
                  for dtype, rows, d in [("bfloat16", 16, 64), ("bfloat16", 16, 128), ("bfloat16", 4, 256),
                                         ("int8", 2, 128), ("float32", 1, 64), ("bfloat16", 6, 128)]}))
"""


def test_the_pool_counts_a_tpus_tile_padding():
    """A page's bytes on a TPU, as XLA lays the pinned row-major cache out: the last axis in
    128-lane rows, the 2K axis in whole sublane tiles (2 rows for bf16, 4 for int8, 8 past 4)."""
    proc = subprocess.run(
        [sys.executable, "-c", PADDING], capture_output=True, text=True, timeout=300, env=tpu_compiler_env(), cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ratios = json.loads(proc.stdout.splitlines()[-1])
    assert ratios == {
        "bfloat16 16x64": 2.0,
        "bfloat16 16x128": 1.0,
        "bfloat16 4x256": 1.0,
        "int8 2x128": 2.0,
        "float32 1x64": 2.0,
        "bfloat16 6x128": 8 / 6,
    }, ratios


def test_pipeline_stages_compile_for_a_slice_and_halve_each_chips_layers():
    """Four layers of the 8B shape in two stages of 2-way tensor parallelism on a v5e 2x2 slice
    against all four chips tensor-parallel: each chip holds half the layers at half the split
    (the same bytes), and a page costs it its own stage's layers only; the staged step (a tick of
    the pipeline with a batch on each stage, worker/pipelined.py) keeps the cache and the fused
    weights in place."""
    common = ["--shape", "llama-3.1-8b", "--num-layers", "4", "--topology", "v5e:2x2", "--buckets", "8"]
    common += ["--max-num-batched-tokens", "8", "--max-num-seqs", "32", "--max-model-len", "8192"]
    (flat, *_), (staged, *variants) = (
        aot(*common, "--mesh", "tensor=4", "--decode-steps", "1"),
        aot(*common, "--mesh", "stage=2,tensor=2"),
    )
    assert staged["mesh"]["stage"] == 2 and staged["mesh"]["tensor"] == 2
    assert [(v["bucket"], v["num_steps"], v.get("tick")) for v in variants] == [(8, 1, True)]  # no window
    for v in variants:
        assert "error" not in v, v
        assert v["cache_copies"] == 0 and v["weight_copies"] == {}, v
        assert v["argument_gib"] + v["temp_gib"] < v["hbm_gib"], v
    # 2 of 4 layers per chip at tensor=2 = 4 of 4 at tensor=4 in layer bytes, and the embedding
    # and LM head split by vocabulary over stage and tensor, 4 ways as in the flat mesh.
    assert staged["param_gib_per_chip"] == pytest.approx(flat["param_gib_per_chip"], rel=0.01)
    # A page costs a staged chip 2 layers of 4 of the 8 KV heads, a flat one 4 layers of 2: the
    # same, so the pool holds as many pages.
    assert staged["num_pages"] == flat["num_pages"]
