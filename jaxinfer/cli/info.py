"""`jaxinfer info`: the model, the devices and what the KV cache holds, without compiling."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxinfer.cli.args import add_engine_args, engine_options
from jaxinfer.cli.options import read_options
from jaxinfer.config import EngineConfig
from jaxinfer.config.engine import OPTION_GROUPS

if TYPE_CHECKING:
    from jaxinfer.loader import LoadedModel
    from jaxinfer.tokenizer import Tokenizer
    from jaxinfer.worker.device_state import DeviceState


def describe(args: argparse.Namespace) -> dict:
    import jax  # the command line imports JAX only when a command runs

    from jaxinfer.loader import load_model
    from jaxinfer.models.registry import features
    from jaxinfer.quant import QuantConfig, param_bytes, param_count, quantization_of, quantized_tensors
    from jaxinfer.worker.device_state import DeviceState
    from jaxinfer.worker.kv_pool import kv_page_bytes

    engine = EngineConfig(**read_options(args, engine_options()))
    load = engine.load
    quant = QuantConfig.parse(load.quantization, load.quantization_group_size, load.quantize_embedding)
    model = load_model(load.model, load.dtype, quantization=quant)
    stored_bytes, num_params = param_bytes(model.params), param_count(model.params)  # before DeviceState's layout
    max_len = engine.scheduler.max_model_len or model.config.max_position_embeddings
    state = DeviceState(model, engine, max_len)  # the pool as an engine would allocate it; nothing compiles
    usable = state.num_pages - 1  # page 0 is the null page
    return {
        "model": {
            "path": str(model.path),
            **{k: v for k, v in dataclasses.asdict(model.config).items()},
            "features": features(model.config),
            "parameters": int(num_params),
            "dtype": str(model.params.embed.dtype),
            "quantization": model.quantization and model.quantization.method,
            "quantization_scheme": _scheme(model.quantization),
            "quantized_storage": quantization_of(model.params),
            "quantized_tensors": quantized_tensors(model.params),
            "param_bytes": param_bytes(state.params),
            "stored_param_bytes": stored_bytes,
            "embedding": _embedding(model),
            "tokenizer": repr(model.tokenizer),
            "tool_call_format": _tool_call_format(args, model.tokenizer),
        },
        "devices": [{"id": d.id, "platform": d.platform, "kind": d.device_kind} for d in jax.devices()],
        "backend": jax.default_backend(),
        "kv_cache": {
            "pages": usable,
            "page_size": state.page_size,
            # every layer group holding every token (a sliding-window group holds far fewer)
            "tokens": usable // state.kv_layout.num_groups * state.page_size,
            **_group_capacity(state, usable, max_len, max(engine.buckets())),
            "per": "data replica" if state.num_replicas > 1 else "engine",
            "bytes": state.kv_cache_bytes,
            "bytes_per_token": kv_page_bytes(model.config, state.page_size, state.kv_dtype) // state.page_size,
            # what one device holds of the pool, in its memory layout (a TPU pads head_dim 64)
            "device_bytes": state.num_pages
            * kv_page_bytes(
                model.config, state.page_size, state.kv_dtype, state.layout.kv_heads_per_device, state.local_device
            ),
            "dtype": str(state.kv_dtype),
            "max_model_len": max_len,
            **_host_tier(state, engine.cache.kv_offload_gb),
        },
        "token_buckets": list(engine.buckets()),
        "engine_config": _options_json(engine),
        "mesh": None if state.mesh is None else dict(state.mesh.shape),
        "data_replicas": state.num_replicas,
        "startup": _startup(engine, model),
    }


def _startup(engine: EngineConfig, model: Any) -> dict:
    """Where compiled variants and prepared weights are kept, how many variants an engine with
    these options would read from the executable store at its start (its index of this config:
    what such an engine used last), and whether this load's prepared weights are there."""
    import jax

    from jaxinfer.prepared_weights import PreparedWeights
    from jaxinfer.worker.executables import SUFFIX, read_index
    from jaxinfer.worker.programs import index_key, store_path, weights_path
    from jaxinfer.worker.warm_up import compilation_cache_path

    store, stored = store_path(engine), 0
    if store is not None:
        keys = read_index(store / "index" / f"{index_key(engine)}.json")
        stored = sum((store / f"{key}{SUFFIX}").is_file() for key in keys)
    cache = compilation_cache_path(engine.compile.compilation_cache_dir)
    weights, kept = weights_path(engine), False
    if weights is not None and isinstance(model.path, Path) and model.path.suffix == ".gguf":
        entry = PreparedWeights(weights, model.path, engine.load.dtype, model.quantization, jax.devices()[0])
        kept = entry.path.is_file()
    return {
        "executable_store": None if store is None else str(store),
        "stored_variants": stored,
        "prepared_weights": None if weights is None else str(weights),
        "prepared_weights_kept": kept,
        "compilation_cache": None if cache is None else str(cache),
        "compile_in_background": engine.compile.compile_in_background,
    }


def _scheme(quant: Any) -> str | None:
    """How a stored checkpoint's layers are quantized, e.g. "compressed-tensors: W4A16 g128"."""
    if quant is None:
        return None
    if quant.stored is not None:
        return quant.stored.describe()
    acts = "" if quant.activations is None else ", {} activations per {}".format(*quant.activations)
    return f"{quant.method}" + (f" g{quant.group}" if quant.group else "") + acts


def _embedding(model: LoadedModel) -> dict:
    """The token embedding (counted once in param_bytes, however a tied LM head shares it): tied
    or not, quantized or not (`--quantize-embedding`, or a GGUF's blocks kept), its bytes."""
    import jax

    from jaxinfer.quant import QuantizedWeight

    embed = model.params.embed
    quantized = isinstance(getattr(embed, "base", embed), QuantizedWeight)
    nbytes = sum(int(x.nbytes) for x in jax.tree.leaves(embed))
    return {"tied": model.config.tie_word_embeddings, "quantized": quantized, "bytes": nbytes}


def _host_tier(state: DeviceState, gib: float) -> dict:
    """The host tier's pages per replica (kv_offload_gb), as the engine would size it."""
    from jaxinfer.worker.kv_host import host_page_bytes, host_slots

    if not gib:
        return {"host_pages": 0}
    return {
        "host_pages": host_slots(state, gib),
        "host_page_bytes": host_page_bytes(state.kv_caches, state.num_replicas),
    }


def _group_capacity(state: DeviceState, usable: int, max_len: int, chunk: int) -> dict:
    """The layer groups of the KV layout with the pages a sequence of max_model_len tokens holds
    in each (steps of `chunk` tokens), and how many such sequences the pool holds at once."""
    from jaxinfer.kv import group_for

    groups, per_sequence = [], 0
    for window, layers in zip(state.kv_layout.windows, state.kv_layout.groups):
        pages = group_for(window).max_pages_held(max_len, chunk, state.page_size)
        groups.append({"window": window, "layers": list(layers), "pages_per_sequence": pages})
        per_sequence += pages
    return {
        "caches": state.kv_layout.num_caches,
        "groups": groups,
        "max_concurrency": round(usable / per_sequence, 2),  # sequences of max_model_len tokens at once
    }


def _options_json(config: EngineConfig) -> dict:
    """Every EngineConfig option by group, as this command would start an engine with it."""
    out: dict = {}
    for name, value in config.options().items():
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)
        elif not isinstance(value, (str, int, float, bool, list, tuple, dict, type(None))):
            value = str(value)  # a jax Mesh
        group = OPTION_GROUPS[name]
        (out.setdefault(group, {}) if group else out)[name] = value
    return out


def _tool_call_format(args: argparse.Namespace, tokenizer: Tokenizer | None) -> str | None:
    """The format `jaxinfer serve` reads tool calls in by default: the one the chat template shows."""
    from jaxinfer.tokenizer.chat_template import load_chat_template
    from jaxinfer.tokenizer.tool_calls import parser_for_template

    template = (
        load_chat_template(args.chat_template) if args.chat_template else getattr(tokenizer, "chat_template", None)
    )
    parser = parser_for_template(template)
    return parser.name if parser else None


def cmd_info(args: argparse.Namespace) -> int:
    print(json.dumps(describe(args), indent=2))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    info = sub.add_parser("info", help="model, devices and KV cache capacity as JSON")
    add_engine_args(info)
    info.set_defaults(func=cmd_info)
