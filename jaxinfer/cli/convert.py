"""`jaxinfer convert SRC DST`: an HF safetensors directory or a GGUF file -> an orbax checkpoint."""

from __future__ import annotations

import argparse
import sys


def cmd_convert(args: argparse.Namespace) -> int:
    from jaxinfer.convert import convert
    from jaxinfer.quant import QuantConfig

    quant = QuantConfig.parse(args.quantization, args.quantization_group_size, args.quantize_embedding)
    stats = convert(
        args.src,
        args.dst,
        dtype=args.dtype,
        mesh=args.mesh,
        progress=not args.quiet,
        quantization=quant,
        lora=args.lora,
    )
    print(
        f"converted {args.src} -> {args.dst}: {stats.tensors} tensors, "
        f"{stats.parameters / 1e6:.1f}M parameters, {stats.bytes / 2**30:.2f} GiB {stats.dtype}, "
        f"in {stats.seconds:.1f} s",
        file=sys.stderr,
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="convert an HF directory or GGUF file into an orbax checkpoint",
        description="Writes DST: the parameters as an orbax checkpoint, config.json, the tokenizer "
        "files and jaxinfer_checkpoint.json (written last: a directory without it is "
        "a conversion that did not finish). DST may be a local directory or gs://bucket/path; "
        "serve it with --model DST.",
    )
    p.add_argument("src", help="HF model directory (config.json + safetensors) or .gguf file")
    p.add_argument("dst", help="new checkpoint directory (must not exist, or be empty)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32", "float16"],
        help="auto: the HF checkpoint's own floating dtype; bfloat16 for GGUF files",
    )
    p.add_argument(
        "--mesh",
        default=None,
        help="split the arrays over these devices while converting (e.g. tensor=8), so a "
        "model larger than one device converts; the checkpoint itself fits any mesh",
    )
    p.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "int8", "int4", "gguf", "compressed-tensors", "gptq", "awq"],
        help="save every linear weight quantized (int8 per output channel, int4 group-wise), "
        "or keep a GGUF file's quantized blocks (gguf); auto keeps a checkpoint stored quantized "
        "(compressed-tensors, gptq, awq) as stored and is none for the rest on the CPU (gguf on accelerators)",
    )
    p.add_argument(
        "--quantize-embedding", action="store_true", help="with int8 / int4: the embedding and LM head quantized too"
    )
    p.add_argument(
        "--quantization-group-size",
        type=int,
        default=None,
        help="int4: inputs sharing one scale and zero point (default 64)",
    )
    p.add_argument(
        "--lora",
        default=None,
        metavar="DIR",
        help="a LoRA adapter (PEFT directory) merged into the weights (HF sources)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_convert)
