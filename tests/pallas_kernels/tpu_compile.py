"""Compiles the TPU kernels for real TPU chips on a machine that has none.

libtpu's deviceless topologies (`jax.experimental.topologies.get_topology_desc`) give XLA:TPU
compile-only devices: jitting for them runs the whole TPU compiler, Mosaic's own passes
included (vector layouts, DMAs, VMEM and SMEM allocation), which lowering alone never reaches.

    PYTHONPATH=.venv/tpu-compiler python tests/pallas_kernels/tpu_compile.py [CASE ...]

prints one JSON line per case: {"case", "chip", "ok", "seconds", "error"}. `tools/install.sh
--test` installs libtpu (the version jax's `tpu` extra pins) into .venv/tpu-compiler, off the
venv's own path so that no other process loads it; test_tpu_compile.py runs this file in a
subprocess with that folder on its path.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402
from rpa_cases import operand_structs  # noqa: E402  (this file's folder, first on sys.path)

from pallas_kernels import tpu, tpu_config  # noqa: E402

TOPOLOGIES = {"v5e": "v5e:1x1", "v6e": "v6e:1x1", "7x": "tpu7x:1x1"}

# name -> (chip, batch shape, kernel options). Shapes: what differs from rpa_cases.operand_structs'
# defaults (64 tokens, 8 query and 2 kv heads, head_dim 128, 64 pages of 16, 8 sequences of 16
# pages, bfloat16).
CASES = {
    "v5e-bf16": ("v5e", {}, {}),
    "v6e-bf16": ("v6e", {}, {}),
    "7x-bf16": ("7x", {}, {}),
    "v5e-f32-d64-gqa3": ("v5e", dict(dtype="float32", head_dim=64, q_heads=6), {}),
    "v5e-int8-kv": ("v5e", dict(cache_dtype="int8", page_size=32), {}),
    "v6e-fp8-kv": ("v6e", dict(cache_dtype="float8_e4m3fn", page_size=32), {}),
    "v5e-window-cap": ("v5e", {}, dict(sliding_window=128, soft_cap=30.0)),
    "v5e-odd-sizes": ("v5e", dict(tokens=50, pages=37, seqs=5, pages_per_seq=9), {}),
    "v5e-mqa-d256": ("v5e", dict(q_heads=4, kv_heads=1, head_dim=256), {}),
    # Decode at batch 256 with a page table of 256 x 512 pages (8k context in pages of 16): the
    # most SMEM a table may take (tpu_config.PAGE_TABLE_SMEM_BYTES).
    "v5e-decode-256x8k": ("v5e", dict(tokens=256, seqs=256, pages_per_seq=512, pages=4096), {}),
    # f32 prefill, head_dim 256, 8 query heads per kv head: asks past the default scoped VMEM.
    "v5e-f32-d256-gqa8": (
        "v5e",
        dict(tokens=512, q_heads=8, kv_heads=1, head_dim=256, dtype="float32", seqs=2, pages_per_seq=64),
        {},
    ),
    # Query groups of 1 and 2 rows (decode [G, D] operands under one sublane tile).
    "v5e-group1-group2": ("v5e", dict(q_heads=4, kv_heads=2), {}),
    "v6e-mha": ("v6e", dict(q_heads=4, kv_heads=4), {}),
    # SmolLM2's 3 kv heads: 6 rows a token, which Mosaic cannot fold for the strided read.
    "v5e-d64-kv3": ("v5e", dict(q_heads=9, kv_heads=3, head_dim=64), {}),
}
# Must fail in Mosaic's allocator, with these words: one ragged call whose blocks need more VMEM
# than the limit it asks for; a page table of 2 MiB (256 x 2048 pages) with the kernel's own
# check of its size lifted (`unsupported_reason` refuses it before tracing otherwise).
FAILING = {
    "v5e-over-vmem": ("v5e", {}, dict(config=tpu.TpuConfig(block_q=256, pages_per_block=32, vmem_limit_bytes=1 << 20))),
    "v5e-table-over-smem": (
        "v5e",
        dict(tokens=256, seqs=256, pages_per_seq=2048, pages=4096),
        dict(lift_table_check=True),
    ),
}
FAILING_WORDS = {"v5e-over-vmem": "memory space vmem", "v5e-table-over-smem": "space=smem"}


def compile_case(name: str) -> dict:
    chip, shape, opts = {**CASES, **FAILING}[name]
    opts, limit = dict(opts), tpu_config.PAGE_TABLE_SMEM_BYTES
    device = topologies.get_topology_desc(TOPOLOGIES[chip], "tpu").devices[0]
    mesh = Mesh([device], ("x",))
    args, scales = operand_structs(**shape, sharding=NamedSharding(mesh, PartitionSpec()))
    if opts.pop("lift_table_check", False):
        tpu_config.PAGE_TABLE_SMEM_BYTES = 1 << 40
    kernel = functools.partial(tpu.ragged_paged_attention_tpu, sm_scale=0.1, **opts)
    start = time.perf_counter()
    try:
        with jax.set_mesh(mesh):  # the kernel sizes its blocks for the mesh's chip
            jax.jit(kernel).trace(*args, **scales).lower().compile()
        error = None
    except Exception as e:  # noqa: BLE001 - reported, the next case still runs
        error = f"{type(e).__name__}: {e}"[:4000]
    finally:
        tpu_config.PAGE_TABLE_SMEM_BYTES = limit
    return {
        "case": name,
        "chip": chip,
        "device_kind": device.device_kind,
        "ok": error is None,
        "seconds": round(time.perf_counter() - start, 1),
        "error": error,
    }


if __name__ == "__main__":
    for case in sys.argv[1:] or [*CASES, *FAILING]:
        print(json.dumps(compile_case(case)), flush=True)
