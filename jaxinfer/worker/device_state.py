"""DeviceState: what an engine keeps on its devices -- the placed parameters and the paged KV
caches -- and the mesh they live on.

Built once per engine, before anything compiles: the mesh from EngineConfig.parallel, the
parameters placed by the family's logical-axis rules (sharding/), then the KV pool sized to what
memory is left (kv_pool.py), zeroed in the pinned row-major layout the attention kernels read and,
for int8 / fp8 caches, calibrated (kv_calibration.py). The compiled step (compiled_step.py)
donates `kv_caches` to every launch and puts the returned caches back here.

The caches follow the model's KV layout (config/kv_layout.py): one per layer, or, where full and
sliding-window layers mix, one per slot of a layer group, shared by the groups through their page
tables. On a mesh the parameters are split by the family's rules, each cache by KV heads over
`tensor`; with `data` > 1 every cache gets a leading [data] axis (one pool per replica). Every
host allocates the same pool: process 0's page count wins.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.config import EngineConfig
from jaxinfer.config.kv_layout import kv_layout
from jaxinfer.loader import LoadedModel
from jaxinfer.models.registry import KVCaches, ModelParams
from jaxinfer.quant.kv_cache import is_quantized_kv, resolve_kv_dtype
from jaxinfer.worker.host_memory import reuse_freed_heap
from jaxinfer.worker.kv_calibration import calibrated_caches
from jaxinfer.worker.kv_pool import cache_struct, plan_num_pages, zeroed_caches
from jaxinfer.worker.lora_state import SlotWriter, attach, detach, lora_param_axes
from jaxinfer.worker.stages import place_staged, stage_plan
from sharding import DATA, SEQUENCE, axis_size, head_layout, kv_cache_spec, make_mesh, pin_weight_layouts, shard_params
from sharding.experts import check_expert_axis
from sharding.multihost import broadcast_int
from sharding.stages import stage_cache_spec


class DeviceState:
    def __init__(self, model: LoadedModel, engine: EngineConfig, max_model_len: int):
        engine = engine.with_page_size(max_model_len)
        self.model, self.config, self.engine = model, model.config, engine
        self.family = model.family
        self.max_model_len = max_model_len
        self.page_size = engine.cache.chosen_page_size
        self.pages_per_seq = -(-max_model_len // self.page_size)
        self.mesh = make_mesh(engine.parallel.mesh) if engine.parallel.mesh is not None else None
        check_expert_axis(self.mesh, self.config.num_experts)
        self.layout = head_layout(self.mesh, self.config.num_heads, self.config.num_kv_heads)
        self.num_replicas = axis_size(self.mesh, DATA)
        self.row_split = axis_size(self.mesh, SEQUENCE)  # each shard of `sequence` holds its rows of a page
        if self.page_size % self.row_split:
            raise ValueError(
                f"mesh sequence={self.row_split} splits each page's rows: page_size={self.page_size} must divide by it"
            )
        self.kv_layout = kv_layout(self.config)  # which layers share a cache and a page table
        self.stages = stage_plan(self.config, engine, self.mesh)  # None without pipeline stages
        self.params = self._place_params(model)
        self.kv_dtype = resolve_kv_dtype(engine.cache.kv_cache_dtype, model.params.embed.dtype)
        self.num_pages = broadcast_int(
            plan_num_pages(
                self.config,
                engine,
                self.kv_dtype,
                self.layout.kv_heads_per_device,
                self.local_device,
                self.num_caches,
                self.row_split,
            )
        )
        self.kv_caches = self._allocate_kv_caches()
        lora = engine.lora
        self.lora_writer = SlotWriter(self, self.config, lora, self.layout.kv_repeat) if lora.enable_lora else None
        if engine.compile.cpu_heap_reuse and jax.default_backend() == "cpu":  # after loading's transients
            reuse_freed_heap()

    def _place_params(self, model: LoadedModel) -> ModelParams:
        """The parameters as the step computes with them: the family's layout, the LoRA slots'
        stacks attached (worker/lora_state.py), placed on the mesh, fused weights pinned to their
        matmuls' layout on a TPU. The model is left holding one copy of each weight."""
        if self.family.compute_layout is not None:
            model.params = self.family.compute_layout(model.params, self.mesh)
        params, axes = model.params, dict(self.family.param_axes)
        if self.engine.lora.enable_lora:
            lora_dtype = self.engine.lora.lora_dtype
            dtype = model.params.embed.dtype if lora_dtype == "auto" else jax.numpy.dtype(lora_dtype)
            params = attach(params, self.config, self.engine.lora, dtype)
            axes = lora_param_axes(axes)
        if self.mesh is None:
            device = next(iter(jax.tree.leaves(model.params)[0].devices()))
            placed = jax.tree.map(lambda x: jax.device_put(x, device) if isinstance(x, np.ndarray) else x, params)
        elif self.stages is not None:
            placed = place_staged(params, axes, self.mesh, self.layout, self.stages)
        else:
            placed = shard_params(params, axes, self.mesh, self.layout)
        params = pin_weight_layouts(placed, axes)
        if any(a is not b for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(params), strict=True)):
            model.params = detach(params)  # relaid on a TPU
        return params

    def _allocate_kv_caches(self) -> KVCaches:
        sharding = self.home
        if self.mesh is not None:
            spec = kv_cache_spec(self.mesh, replicas=self.num_replicas > 1)
            sharding = NamedSharding(self.mesh, spec if self.stages is None else stage_cache_spec(spec))
        pages = zeroed_caches(
            cache_struct(
                self.num_pages,
                self.page_size,
                self.layout.cache_kv_heads,
                self.config.head_dim,
                self.kv_dtype,
                sharding,
                self.num_replicas,
                1 if self.stages is None else self.stages.num_stages,
            ),
            self.num_caches,
        )
        if is_quantized_kv(self.kv_dtype):  # int8 / fp8: per-head scales calibrated here
            return calibrated_caches(
                pages,
                self.model,
                self.params,
                self.layout.cache_kv_heads,
                self.engine.compile.attn_impl,
                self.mesh,
                self.kv_layout.layer_caches if self.stages is None else None,  # staged: one cache per slot
            )
        return pages

    @property
    def num_caches(self) -> int:
        """KV caches the step carries: one per slot of the KV layout, or per pipeline slot."""
        return self.kv_layout.num_caches if self.stages is None else self.stages.num_slots

    @property
    def home(self) -> SingleDeviceSharding | NamedSharding:
        """Where the step's small carried arrays live: the device of a model without a mesh (its
        embedding table's), else replicated over the mesh."""
        if self.mesh is not None:
            return NamedSharding(self.mesh, P())
        return SingleDeviceSharding(next(iter(jax.tree.leaves(self.params.embed)[0].devices())))

    @property
    def local_device(self) -> jax.Device:
        """A device of this process holding the model: its platform and memory plan the pool."""
        return jax.tree.leaves(self.params.embed)[0].addressable_shards[0].device

    def mesh_context(self) -> contextlib.AbstractContextManager[Any]:
        """The mesh the step is traced and launched under (layers read it back)."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    @property
    def kv_cache_bytes(self) -> int:
        return sum(c.nbytes for c in jax.tree.leaves(self.kv_caches))
