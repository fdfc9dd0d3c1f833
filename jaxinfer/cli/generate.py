"""`jaxinfer generate` (prompts in, completions on stdout) and `jaxinfer chat` (interactive)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from jaxinfer.cli.args import add_engine_args, add_sampling_args, check_file, make_llm, sampling_params
from jaxinfer.lora.request import LoRARequest
from jaxinfer.outputs import CompletionOutput, RequestOutput, logprobs_json
from jaxinfer.sampling.beam import BeamSearchParams


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    empty = [i for i, p in enumerate(prompts, start=1) if not p.strip()]
    if empty:
        raise ValueError(f"prompt {empty[0]} is empty")
    check_file("--prompts-file", args.prompts_file)
    if args.prompts_file:
        stream = sys.stdin if args.prompts_file == "-" else open(args.prompts_file, encoding="utf-8")
        with stream:
            prompts += [line.rstrip("\n") for line in stream if line.strip()]
    if not prompts:
        raise ValueError("no prompt given: pass PROMPT arguments or --prompts-file FILE")
    return prompts


def check_logprob_flags(args: argparse.Namespace, where: str) -> None:
    """--logprobs / --prompt-logprobs print only in JSON lines: refused (before the model loads)
    where text is printed, rather than computed and dropped."""
    for flag, value in (("--logprobs", args.logprobs), ("--prompt-logprobs", args.prompt_logprobs)):
        if value is not None:
            raise ValueError(f"{flag} {value}: {where} prints text only; use generate --output-format jsonl")


def cmd_generate(args: argparse.Namespace) -> int:
    texts = read_prompts(args)
    params = sampling_params(args)
    beam = beam_params(args)  # --beam-width: a beam search per prompt, its beams best first
    if args.output_format == "text":
        check_logprob_flags(args, "--output-format text")
    # Compile only the variants this job uses, and only once every prompt is known to fit.
    llm = make_llm(
        args, penalties=params.uses_penalties, warm_up=False, prompt_logprobs=params.prompt_logprobs is not None
    )
    prompts: Sequence[str | list[int]] = texts
    if args.chat:
        prompts = [llm.render_chat([{"role": "user", "content": p}]) for p in texts]
    checked = []  # each prompt tokenized and checked once, here, before anything compiles
    for i, prompt in enumerate(prompts, start=1):
        try:
            checked.append(llm.engine.check_request(prompt, beam or params))
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None
    if llm.engine.worker.swap_cost is not None:  # a host tier times the step at warm-up (its swap cost)
        llm.engine.warm_up()
    # Otherwise nothing more is compiled ahead: each variant these prompts need compiles (or is read
    # from the persistent compilation cache) when the step first needs it, and no other.
    outputs = llm.generate(checked, use_tqdm=sys.stderr.isatty(), lora_request=lora_request(args))
    for out in outputs:
        for completion in out.outputs:
            if args.output_format == "jsonl":
                print(
                    json.dumps(
                        {
                            "request": int(out.request_id),
                            "index": completion.index,
                            "text": completion.text,
                            "finish_reason": completion.finish_reason,
                            "prompt_tokens": out.usage.prompt_tokens,
                            "completion_tokens": len(completion.token_ids),
                            **_logprobs(out, completion),
                            **({"cumulative_logprob": completion.cumulative_logprob} if beam else {}),
                        },
                        ensure_ascii=False,
                    )
                )
            else:
                print(completion.text)
    return 0


def beam_params(args: argparse.Namespace) -> BeamSearchParams | None:
    """--beam-width W (with --max-tokens, --ignore-eos, --length-penalty): a beam search."""
    if args.beam_width is None:
        if args.length_penalty is not None:
            raise ValueError("--length-penalty: only with --beam-width")
        return None
    return BeamSearchParams(
        beam_width=args.beam_width,
        max_tokens=args.max_tokens,
        ignore_eos=bool(args.ignore_eos),
        temperature=args.temperature,
        length_penalty=1.0 if args.length_penalty is None else args.length_penalty,
    )


def _logprobs(out: RequestOutput, completion: CompletionOutput) -> dict:
    """The logprobs fields of a JSON line: those asked for (--logprobs, --prompt-logprobs)."""
    fields = {}
    if completion.logprobs is not None:
        fields["logprobs"] = logprobs_json(completion.logprobs)
    if out.prompt_logprobs is not None:
        fields["prompt_logprobs"] = logprobs_json(out.prompt_logprobs)
    return fields


def cmd_chat(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    check_logprob_flags(args, "chat")
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
        for delta in llm.stream(llm.render_chat(messages), params, lora_request=lora_request(args)):
            piece = delta.outputs[0].text
            reply += piece
            print(piece, end="", flush=True)
        print(flush=True)
        messages.append({"role": "assistant", "content": reply})


def lora_request(args: argparse.Namespace) -> LoRARequest | None:
    """--lora NAME: one of --lora-modules (its path given there), or NAME=PATH."""
    if args.lora is None:
        return None
    name, _, path = args.lora.partition("=")
    return LoRARequest(name, 1, path)


LORA_HELP = "run under this LoRA adapter: a name from --lora-modules, or NAME=PATH (needs --enable-lora)"


def register(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="generate completions for prompts (text on stdout)")
    gen.add_argument("prompt", nargs="*", help="prompt text (several allowed)")
    gen.add_argument("--prompts-file", help="file with one prompt per line ('-' = stdin)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--output-format", choices=["text", "jsonl"], default="text")
    gen.add_argument("--lora", metavar="NAME", help=LORA_HELP)
    gen.add_argument(
        "--beam-width", type=int, default=None, metavar="W", help="beam search: W beams per prompt, best first"
    )
    gen.add_argument("--length-penalty", type=float, default=None, help="beam search: score / length ** this (1.0)")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat, streaming replies (one message per line on stdin)")
    chat.add_argument("--system", default=None, help="system message")
    chat.add_argument("--lora", metavar="NAME", help=LORA_HELP)
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)
