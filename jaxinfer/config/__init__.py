"""Configuration, free of JAX until an engine is built from it.

engine.py       EngineConfig: every option of an engine, in the typed groups below
load.py         LoadConfig: the model, its weights' dtype and quantization, its text format
cache.py        CacheConfig: the paged KV cache
scheduler.py    SchedulerConfig: step budget, context length, per-request limits, step loop
compile.py      CompileConfig: step variants, launch, compilation cache
parallel.py     ParallelConfig: device mesh and hosts
lora.py         LoraConfig: LoRA adapters -- device slots, rank, host cache, adapters named at start-up
kv_transfer.py  KVTransferConfig: the engine's role in disaggregated prefill/decode, where it offers pages
speculative.py  SpeculativeConfig: speculative decoding's method and sizes
checks.py       the groups' shared checks
model.py        ModelConfig, read from an HF config.json or GGUF metadata
kv_layout.py    KVLayout: which layers share a KV cache and a page table (full / sliding groups)
families.py     the catalog of model families (JAX-free descriptions; each family's config reading)
errors.py       ConfigError
"""

from jaxinfer.config.cache import CacheConfig
from jaxinfer.config.compile import CompileConfig
from jaxinfer.config.engine import EngineConfig
from jaxinfer.config.kv_transfer import KVTransferConfig
from jaxinfer.config.load import LoadConfig
from jaxinfer.config.lora import LoraConfig, LoraModule
from jaxinfer.config.model import ConfigError, ModelConfig
from jaxinfer.config.parallel import ParallelConfig
from jaxinfer.config.scheduler import SchedulerConfig
from jaxinfer.config.sources import RopeScaling
from jaxinfer.config.speculative import SpeculativeConfig

__all__ = [
    "CacheConfig",
    "CompileConfig",
    "ConfigError",
    "EngineConfig",
    "KVTransferConfig",
    "LoadConfig",
    "LoraConfig",
    "LoraModule",
    "ModelConfig",
    "ParallelConfig",
    "RopeScaling",
    "SchedulerConfig",
    "SpeculativeConfig",
]
