"""`jaxinfer info`: the model, the devices and what the KV cache holds, without compiling."""
from __future__ import annotations

import argparse
import dataclasses
import json

from jaxinfer.cli.args import add_engine_args
from jaxinfer.config import EngineConfig


def describe(args: argparse.Namespace) -> dict:
    import jax  # the command line imports JAX only when a command runs

    from jaxinfer.loader import load_model
    from jaxinfer.models.registry import features
    from jaxinfer.worker.kv_pool import kv_page_bytes
    from jaxinfer.worker.runner import ModelRunner

    from jaxinfer.quant import QuantConfig, param_bytes, param_count, quantization_of, quantized_tensors

    quant = QuantConfig.parse(args.quantization, args.quantization_group_size, args.quantize_embedding)
    model = load_model(args.model, args.dtype, quantization=quant)
    engine = EngineConfig(page_size=args.page_size, num_pages=args.num_pages,
                          kv_cache_memory_fraction=args.kv_cache_memory_fraction,
                          kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          mesh=args.mesh, attn_impl=args.attn_impl)
    max_len = engine.max_model_len or model.config.max_position_embeddings
    runner = ModelRunner(model, engine, max_len)
    num_params = param_count(model.params)
    usable = runner.num_pages - 1  # page 0 is the null page
    return {
        "model": {"path": str(model.path), **{k: v for k, v in dataclasses.asdict(model.config).items()},
                  "features": features(model.config),
                  "parameters": int(num_params), "dtype": str(model.params.embed.dtype),
                  "quantization": model.quantization and model.quantization.method,
                  "quantized_storage": quantization_of(model.params),
                  "quantized_tensors": quantized_tensors(model.params), "param_bytes": param_bytes(runner.params),
                  "tokenizer": repr(model.tokenizer), "tool_call_format": _tool_call_format(args, model.tokenizer)},
        "devices": [{"id": d.id, "platform": d.platform, "kind": d.device_kind} for d in jax.devices()],
        "backend": jax.default_backend(),
        "kv_cache": {"pages": usable, "page_size": runner.engine.page_size, "tokens": usable * runner.engine.page_size,
                     "per": "data replica" if runner.num_replicas > 1 else "engine",
                     "bytes": runner.kv_cache_bytes, "bytes_per_token":
                     kv_page_bytes(model.config, runner.engine.page_size, runner.kv_dtype) // runner.engine.page_size,
                     # what one device holds of the pool, in its memory layout (a TPU pads head_dim 64)
                     "device_bytes": runner.num_pages * kv_page_bytes(
                         model.config, runner.engine.page_size, runner.kv_dtype, runner.layout.kv_heads_per_device,
                         runner.local_device),
                     "dtype": str(runner.kv_dtype), "max_model_len": max_len},
        "token_buckets": list(engine.buckets()),
        "mesh": None if runner.mesh is None else dict(runner.mesh.shape),
        "data_replicas": runner.num_replicas,
    }


def _tool_call_format(args: argparse.Namespace, tokenizer) -> str | None:
    """The format `jaxinfer serve` reads tool calls in by default: the one the chat template shows."""
    from jaxinfer.tokenizer.chat_template import load_chat_template
    from jaxinfer.tokenizer.tool_calls import parser_for_template

    template = load_chat_template(args.chat_template) if args.chat_template else getattr(
        tokenizer, "chat_template", None)
    parser = parser_for_template(template)
    return parser.name if parser else None


def cmd_info(args: argparse.Namespace) -> int:
    print(json.dumps(describe(args), indent=2))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    info = sub.add_parser("info", help="model, devices and KV cache capacity as JSON")
    add_engine_args(info)
    info.set_defaults(func=cmd_info)
