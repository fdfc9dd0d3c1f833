"""Compiles the engine's step for a TPU slice on a machine without a TPU, and reports what each
chip would hold.

    PYTHONPATH=.venv/tpu-compiler python benchmarks/tpu_aot.py --shape llama-3.1-8b \\
        --topology v5e:2x2 --mesh tensor=4 [--max-model-len 8192] [--buckets 1 64 512]

libtpu's deviceless topologies (`jax.experimental.topologies`; `tools/install.sh --test` puts
libtpu in .venv/tpu-compiler) stand in for the chips. For each token bucket, and for the decode
window at the decode-sized ones, the step is traced with the shapes and shardings the engine
gives it on that mesh (parameters of the shape by the model's logical axes, KV heads repeated
where the layout asks; the paged KV cache; the inputs), compiled by XLA:TPU with the Pallas TPU
kernel inside, and `memory_analysis()` gives one chip's arguments, outputs and temporaries beside
its HBM, `cache_copies` counts copies of a whole layer's cache in the compiled step and
`weight_copies` relayouts of a fused weight. The KV
pool takes what the engine would take (`kv_cache_memory_fraction` of the HBM the weights leave) unless
--num-pages says otherwise.
With a `data` axis the step is vmapped over the replicas as the runner runs it (caches and inputs
with a leading [data] axis; replicas run single steps, no windows). `--quantization int8|int4`
gives the linear weights the structure a quantized load gives them (integers, scales, int4
offsets), so the pool and the temporaries are those of the quantized model. One JSON line per
compiled variant.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from benchmarks.shapes import SHAPES, shape_config  # noqa: E402
from jaxinfer.config import EngineConfig  # noqa: E402
from jaxinfer.config.kv_layout import kv_layout  # noqa: E402
from jaxinfer.models.linear_layout import LAYER_LINEARS  # noqa: E402
from jaxinfer.models.reading import resolve_dtype  # noqa: E402
from jaxinfer.models.registry import get_family  # noqa: E402
from jaxinfer.quant.config import DEFAULT_GROUP_SIZE, QuantConfig, component_shapes  # noqa: E402
from jaxinfer.quant.kv_cache import QuantizedKVCache, is_quantized_kv, resolve_kv_dtype, scales_array  # noqa: E402
from jaxinfer.quant.weights import QuantizedWeight  # noqa: E402
from jaxinfer.worker.inputs import InputBuilder  # noqa: E402
from jaxinfer.worker.kv_pool import cache_struct, plan_num_pages  # noqa: E402
from jaxinfer.worker.pipelined import inflight_struct, stack_rows, tick_jit, tick_shardings  # noqa: E402
from jaxinfer.worker.stages import stage_plan  # noqa: E402
from jaxinfer.worker.step_variants import (
    decode_sized_buckets,
    decode_steps,
    input_shardings,
    split_step_enabled,  # noqa: E402
    step_jits,
)
from pallas_kernels.kv_layout import layout_bytes  # noqa: E402
from pallas_kernels.tpu_blocks import target_chip  # noqa: E402
from sharding import DATA, SEQUENCE, axis_size, head_layout, kv_cache_spec, leaf_name, make_mesh, param_structs  # noqa: E402
from sharding.stages import stacked_structs, stage_cache_spec, stage_mesh  # noqa: E402


def shard_bytes(structs) -> int:
    """Bytes one device holds of a tree of sharded shape structs."""
    return sum(int(np.prod(s.sharding.shard_shape(s.shape))) * s.dtype.itemsize for s in jax.tree.leaves(structs))


# The fused linear weights weight-only quantization replaces, by their input axes (as loaded:
# jaxinfer.quant), a mixture's stacked experts included.
QUANTIZED_INPUTS = {**LAYER_LINEARS, "experts_gate_up": (1,), "experts_down": (1,)}


def quantized(params, quant: QuantConfig | None):
    """Shape structs of the parameters with each linear weight as the loader quantizes it: a
    QuantizedWeight of its integers' and scales' (and int4 offsets') structs."""

    def replace(path, x):
        inputs = QUANTIZED_INPUTS.get(leaf_name(path))
        if quant is None or inputs is None:
            return x
        parts = {
            name: jax.ShapeDtypeStruct(shape, dtype)
            for name, (shape, dtype) in component_shapes(x.shape, inputs, quant, x.dtype).items()
        }
        return QuantizedWeight(
            parts["values"],
            parts["scales"],
            None,
            quant.method,
            inputs,
            quant.group_size,
            parts.get("offsets"),
            x.dtype,
        )

    return jax.tree_util.tree_map_with_path(replace, params)


class AotStep:
    """The engine's step for one model shape on a mesh of compile-only TPU devices."""

    def __init__(
        self,
        shape: str,
        topology: str,
        mesh: str,
        engine: EngineConfig,
        dtype: str,
        num_layers: int | None = None,
        quant: QuantConfig | None = None,
    ):
        self.config = shape_config(shape, num_layers)
        self.family = get_family(self.config.family)
        self.devices = topologies.get_topology_desc(topology, "tpu").devices
        self.mesh = make_mesh(mesh, self.devices)
        self.replicas = axis_size(self.mesh, DATA)  # the runner's data replicas: a leading [data] axis
        self.max_model_len = engine.scheduler.max_model_len or self.config.max_position_embeddings
        self.engine = engine = engine.with_page_size(self.max_model_len)
        layout = head_layout(self.mesh, self.config.num_heads, self.config.num_kv_heads)
        host = jax.eval_shape(
            functools.partial(self.family.init_params, self.config, jax.random.key(0), resolve_dtype(dtype))
        )
        self.params = self._param_structs(quantized(host, quant), layout)
        with jax.set_mesh(self.mesh):
            self.chip = target_chip()
        self.hbm = pltpu.get_tpu_info_for_chip(pltpu.ChipVersion(self.chip), 1).hbm_capacity_bytes
        kv_dtype = resolve_kv_dtype(engine.cache.kv_cache_dtype, self.params.embed.dtype)
        # The engine's pool: its fraction of what the weights leave of the chip's HBM.
        budget = int((self.hbm - shard_bytes(self.params)) * engine.cache.kv_cache_memory_fraction)
        self.kv_layout = kv_layout(self.config)  # the caches and page tables the engine lays out
        num_caches = self.kv_layout.num_caches if self.stages is None else self.stages.num_slots
        self.num_pages = plan_num_pages(
            self.config,
            engine.replace(kv_cache_bytes=budget),
            kv_dtype,
            layout.kv_heads_per_device,
            self.devices[0],
            num_caches,
            axis_size(self.mesh, SEQUENCE),  # each shard of `sequence` holds its rows of a page
        )
        # As the runner allocates it: row-major layout pinned (pallas_kernels.kv_layout); int8 /
        # fp8 pages with their per-head scales; with stages, each stage's rows of every page.
        spec = kv_cache_spec(self.mesh, replicas=self.replicas > 1)
        placed = NamedSharding(self.mesh, spec if self.stages is None else stage_cache_spec(spec))
        cache = cache_struct(
            self.num_pages,
            engine.cache.page_size,
            layout.cache_kv_heads,
            self.config.head_dim,
            kv_dtype,
            placed,
            self.replicas,
            1 if self.stages is None else self.stages.num_stages,
        )
        if is_quantized_kv(kv_dtype):
            scales = (*cache.shape[:-4], *scales_array(np.ones(2 * layout.cache_kv_heads)).shape)
            cache = QuantizedKVCache(cache, jax.ShapeDtypeStruct(scales, jnp.float32, sharding=placed))
        self.caches = (cache,) * num_caches
        self.buckets = engine.buckets()
        self.inputs = InputBuilder(
            engine,
            self.buckets,
            pages_per_seq=-(-self.max_model_len // engine.cache.page_size),
            max_model_len=self.max_model_len,
            vocab_size=self.config.vocab_size,
            num_replicas=self.replicas,
            num_speculative_tokens=0,
            num_groups=self.kv_layout.num_groups,
            in_flight=self.in_flight,
        )
        self.max_seqs = engine.seq_bucket(self.buckets[-1])

    def _param_structs(self, host, layout):
        """The parameters' structs as the engine places them: over the mesh by their logical
        axes, or with pipeline stages each layer's on its stage and stacked into slots."""
        axes = self.family.param_axes
        self.stages = stage_plan(self.config, self.engine, self.mesh)
        # A batch in flight on every stage (worker/pipelined.py): the engine's step is a tick.
        pipelined = self.engine.parallel.pipeline_batches and self.replicas == 1 and self.family.tick is not None
        self.in_flight = self.stages.num_stages if self.stages is not None and pipelined else 1
        if self.stages is None:
            return param_structs(host, axes, self.mesh, layout)
        top = param_structs(dataclasses.replace(host, layers=()), axes, self.mesh, layout)
        layer = param_structs(host.layers[0], axes, stage_mesh(self.mesh, 0), layout)
        return dataclasses.replace(top, layers=stacked_structs(layer, self.stages, self.mesh))

    def compile(self, bucket: int, num_steps: int = 1, split: bool = False, prompt: bool = False) -> dict:
        """One variant compiled for the topology (the step, its decode window of `num_steps`, the
        split step's forward half, or the step that also scores prompt rows), with the runner's
        own jits: compile time, one chip's memory."""
        replicated = NamedSharding(self.mesh, PartitionSpec())
        host = self.inputs.padding_inputs(bucket, False, prompt=prompt)
        ticks = self.in_flight > 1  # pipeline stages with a batch on each: the tick, every stage's rows
        host = stack_rows([host] * self.in_flight) if ticks else host
        shardings = tick_shardings(self.mesh, host) if ticks else input_shardings(self.mesh, host, self.replicas > 1)
        inputs = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), host, shardings)
        prev_shape = (self.max_seqs,) if self.replicas == 1 else (self.replicas, self.max_seqs)
        prev = jax.ShapeDtypeStruct(prev_shape, jnp.int32, sharding=replicated)
        table = jax.ShapeDtypeStruct(
            (*prev_shape[:-1], self.kv_layout.num_groups, *self.inputs.tables[0].rows.shape[1:]),
            jnp.int32,
            sharding=replicated,
        )
        out_shardings = (replicated, jax.tree.map(lambda c: c.format, self.caches), replicated)
        step_fn, window, forward, _ = step_jits(
            self.family,
            self.config,
            self.engine.compile.attn_impl,
            self.max_seqs,
            self.replicas,
            num_steps,
            out_shardings,
            mesh=self.mesh,
        )
        jitted = forward if split else step_fn if num_steps == 1 else window
        extra: tuple = ()
        if ticks:
            jitted = tick_jit(
                self.family, self.config, self.engine.compile.attn_impl, self.max_seqs, out_shardings, self.mesh
            )
            extra = (inflight_struct(self.params, self.config, self.mesh, self.in_flight, self.buckets[-1]),)
        variant = {
            "bucket": bucket,
            "num_steps": num_steps,
            **({"split": True} if split else {}),
            **({"prompt": True} if prompt else {}),
            **({"tick": True} if ticks else {}),
        }
        start = time.perf_counter()
        try:
            with jax.set_mesh(self.mesh):
                if split:
                    inputs = inputs.replace(sampling=None)  # as dispatch_forward passes them
                compiled = jitted.trace(self.params, self.caches, inputs, prev, table, *extra).lower().compile()
        except jax.errors.JaxRuntimeError as e:  # the compiler's refusal (HBM, VMEM, SMEM) is the result
            return {**variant, "error": str(e)[:2000]}
        seconds = time.perf_counter() - start
        mem = compiled.memory_analysis()
        hlo = compiled.as_text()
        return {
            **variant,
            "compile_s": round(seconds, 1),
            "tpu_custom_calls": hlo.count('custom_call_target="tpu_custom_call"'),
            "cache_copies": len(self.cache_copies(hlo)),
            "weight_copies": self.weight_copies(hlo),
            "argument_gib": round(mem.argument_size_in_bytes / 2**30, 3),
            "output_gib": round(mem.output_size_in_bytes / 2**30, 3),
            "alias_gib": round(mem.alias_size_in_bytes / 2**30, 3),
            "temp_gib": round(mem.temp_size_in_bytes / 2**30, 3),
            "hbm_gib": round(self.hbm / 2**30, 2),
        }

    def cache_copies(self, hlo: str) -> list[str]:
        """Copies of a whole layer's cache shard in the compiled step (a relayout around the
        kernels: their cost is a cache's size in HBM traffic and temporaries, every layer)."""
        pages = self.pages[0]
        shard = pages.sharding.shard_shape(pages.shape)
        dims = "|".join(",".join(map(str, shard[i:])) for i in range(len(shard) - 3))  # [1, P, ...] or [P, ...]
        pattern = re.compile(r"= \w+\[(?:" + dims + r")\]\S* (?:copy|copy-start)\(")
        return [line.strip()[:160] for line in hlo.splitlines() if pattern.search(line)]

    def weight_copies(self, hlo: str) -> dict[str, int]:
        """Copies of each parameter field of 3 or more axes in the compiled step, by field: a
        relayout of a weight before its matmul (sharding/weight_layout.py). A copy is a `copy`,
        a `convert` (a quantized weight's integers turned to floats in memory) or a fusion that
        is not a bitcast, outside fused computations (a retiling inside the
        fusion that reads the weight is no pass over memory of its own), whose output has a
        weight shard's element count (at least 2**20; a tuple's arrays together), so that a
        weight relaid into another shape or sliced into parts counts too. Fields of one element
        count share a name ("w_gate_up|w_down": an int4 gate|up's bytes hold as many values as
        the down projection's)."""
        fields = {}
        for path, p in jax.tree_util.tree_leaves_with_path(self.params):
            size, name = int(np.prod(p.sharding.shard_shape(p.shape))), leaf_name(path)
            if len(p.shape) >= 3 and size >= 2**20 and name not in fields.get(size, "").split("|"):
                fields[size] = f"{fields[size]}|{name}" if size in fields else name
        computations = re.split(r"\n(?=(?:ENTRY )?%\S+ \()", hlo)
        fused = set(re.findall(r" fusion\(.*?calls=%([^,\s]+)", hlo))
        bitcasts = {
            c.split(" ", 1)[0].lstrip("%") for c in computations if re.search(r"\n  ROOT \S+ = \S+ bitcast\(", c)
        }
        pattern = re.compile(r"= (\(?[^=]*?\)?) (?:copy|fusion|convert)\(")  # its output: an array or a tuple
        counts = {}
        for computation in computations:
            if computation.split(" ", 1)[0].lstrip("%") in fused:
                continue
            for line in computation.splitlines():
                called = re.search(r"calls=%([^,\s]+)", line)
                if not (m := pattern.search(line)) or (called and called.group(1) in bitcasts):
                    continue
                size = sum(
                    int(np.prod([int(d) for d in dims.split(",")])) for dims in re.findall(r"\[([\d,]+)\]", m.group(1))
                )
                if (name := fields.get(size)) is not None:
                    counts[name] = counts.get(name, 0) + 1
        return counts

    def summary(self) -> dict:
        return {
            "chip": self.chip,
            "devices": len(self.mesh.devices.flat),
            "mesh": dict(self.mesh.shape),
            "page_size": self.engine.cache.page_size,
            "num_pages": self.num_pages,
            "max_model_len": self.max_model_len,
            "param_gib_per_chip": round(shard_bytes(self.params) / 2**30, 3),
            "kv_dtype": str(self.pages[0].dtype),
            "kv_gib_per_chip": round(
                sum(layout_bytes(c.sharding.shard_shape(c.shape), c.dtype, self.devices[0]) for c in self.pages)
                / 2**30,
                3,
            ),
        }

    @property
    def pages(self) -> list[jax.ShapeDtypeStruct]:
        """Each layer's pages (without the scales of an int8 / fp8 cache)."""
        return [c.pages if isinstance(c, QuantizedKVCache) else c for c in self.caches]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    p.add_argument("--topology", default="v5e:1x1", help="e.g. v5e:2x2, v6e:2x2, tpu7x:2x2x1")
    p.add_argument("--mesh", default="tensor=1", help="axis sizes, e.g. tensor=4 or data=2,tensor=2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-layers", type=int, help="keep only the first layers (quicker compiles)")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--page-size", type=int)
    p.add_argument("--num-pages", type=int)
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the weights' dtype), int8 or fp8")
    p.add_argument("--quantization", choices=("int8", "int4"), help="weight-only quantization of the linear weights")
    p.add_argument(
        "--quantization-group-size",
        type=int,
        help=f"inputs per scale (int4 default: {DEFAULT_GROUP_SIZE}; int8: per channel)",
    )
    p.add_argument("--buckets", type=int, nargs="+", help="token buckets to compile (default: all)")
    p.add_argument("--decode-steps", type=int, default=8, help="decode window length (1: none)")
    p.add_argument(
        "--split",
        action="store_true",
        help="also the split step's forward at decode-sized buckets (on by default on accelerators)",
    )
    p.add_argument(
        "--prompt-logprobs",
        action="store_true",
        help="also each bucket's step that scores prompt rows (--enable-prompt-logprobs)",
    )
    p.add_argument(
        "--plan-only",
        action="store_true",
        help="print the memory plan (weights and KV pool per chip) and compile nothing",
    )
    args = p.parse_args(argv)
    buckets = tuple(sorted(set(args.buckets))) if args.buckets else None
    if buckets and buckets[-1] < args.max_num_batched_tokens:
        buckets = (*buckets, args.max_num_batched_tokens)
    engine = EngineConfig(
        attn_impl="pallas_tpu",
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        page_size=args.page_size,
        num_pages=args.num_pages,
        token_buckets=buckets,
        kv_cache_dtype=args.kv_cache_dtype,
        compilation_cache_dir=None,
    )
    quant = QuantConfig.parse(args.quantization, args.quantization_group_size)
    aot = AotStep(args.shape, args.topology, args.mesh, engine, args.dtype, args.num_layers, quant)
    print(
        json.dumps(
            {"shape": args.shape, "topology": args.topology, "quantization": args.quantization, **aot.summary()}
        ),
        flush=True,
    )
    if args.plan_only:
        return
    decode_sized = decode_sized_buckets(aot.inputs, aot.buckets, args.max_num_seqs)
    for bucket in args.buckets or aot.buckets:
        print(json.dumps(aot.compile(bucket)), flush=True)
        one_at_a_time = aot.in_flight == 1  # pipeline ticks have no window, no split step (worker/pipelined.py)
        if one_at_a_time and decode_steps(args.decode_steps, aot.replicas) > 1 and bucket in decode_sized:
            print(json.dumps(aot.compile(bucket, args.decode_steps)), flush=True)  # a window too
        if one_at_a_time and args.split and split_step_enabled(True, aot.replicas) and bucket in decode_sized:
            print(json.dumps(aot.compile(bucket, split=True)), flush=True)
        if args.prompt_logprobs:
            print(json.dumps(aot.compile(bucket, prompt=True)), flush=True)


if __name__ == "__main__":
    main()
