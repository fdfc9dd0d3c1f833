"""`jaxinfer client`: calls a running jaxinfer server over gRPC (registered by serving/cli.py).

    jaxinfer client generate "Hello" --max-tokens 32  # streams text to stdout
    jaxinfer client generate --chat "Hi there"         # through the chat template
    jaxinfer client generate --chat "Weather?" --tools tools.json --tool-choice required --output-format jsonl
    jaxinfer client generate --token-ids 1,2,3         # token ids in, token ids printed
    jaxinfer client generate "Hello" --lora sql        # under the server's LoRA adapter `sql`
    jaxinfer client tokenize "Hello" | detokenize 1 2 3 | info | stats | health

A call that fails prints "error: CODE: message" on stderr and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported when a command runs
    from google.protobuf.message import Message

    from serving.grpc.client import Client

TOKEN_ENV = "JAXINFER_AUTH_TOKEN"


def add_client_parser(
    subparsers: argparse._SubParsersAction, add_sampling_args: Callable[[argparse.ArgumentParser], None]
) -> None:
    client = subparsers.add_parser("client", help="call a running jaxinfer server")
    client.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT")
    client.add_argument("--auth-token-file", default=None, help=f"bearer token file (or ${TOKEN_ENV})")
    client.add_argument("--tls-ca", default=None, help="PEM root certificates: connect with TLS")
    client.add_argument("--tls", action="store_true", help="TLS with the system's root certificates")
    client.add_argument("--tls-server-name", default=None, help="expected name in the server certificate")
    client.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    actions = client.add_subparsers(dest="action", required=True)
    gen = actions.add_parser("generate", help="stream a completion")
    gen.add_argument("prompt", nargs="?", default=None, help="prompt text")
    gen.add_argument("--token-ids", default=None, help="comma-separated prompt token ids instead of text")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument(
        "--tools",
        default=None,
        metavar="FILE_OR_JSON",
        help="with --chat: OpenAI's tools list (JSON, or a file of it) for the chat template; the "
        "finishing jsonl message carries the calls read back",
    )
    gen.add_argument("--tool-choice", default=None, help="with --tools: auto, none, required, or a tool's name")
    gen.add_argument(
        "--lora",
        default=None,
        metavar="NAME",
        help="the LoRA adapter to run under, by its name on the server (default: the base model)",
    )
    gen.add_argument(
        "--output-format",
        choices=["text", "jsonl"],
        default="text",
        help="text: stream the text; jsonl: one JSON object per streamed message",
    )
    add_sampling_args(gen)
    tok = actions.add_parser("tokenize", help="text -> token ids")
    tok.add_argument("text")
    tok.add_argument("--no-special-tokens", action="store_true")
    detok = actions.add_parser("detokenize", help="token ids -> text")
    detok.add_argument("token_ids", nargs="+", type=int)
    for name, what in (
        ("info", "model information"),
        ("stats", "engine and KV cache state"),
        ("health", "health status"),
    ):
        actions.add_parser(name, help=what)
    client.set_defaults(func=cmd_client)


# --- client -------------------------------------------------------------------------------------
def cmd_client(args: argparse.Namespace) -> int:
    import grpc

    from jaxinfer.cli.args import check_file
    from serving.grpc.auth import read_token
    from serving.grpc.client import Client

    check_file("--auth-token-file", args.auth_token_file)
    check_file("--tls-ca", args.tls_ca)
    token = read_token(os.environ.get(TOKEN_ENV) or None, args.auth_token_file)
    root = open(args.tls_ca, "rb").read() if args.tls_ca else None
    with Client(
        args.server, token=token, root_certificates=root, tls=args.tls, tls_server_name=args.tls_server_name
    ) as client:
        try:
            return _CLIENT_ACTIONS[args.action](client, args)
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1


def _tools_arg(value: str | None) -> list | None:
    """--tools: a JSON list, or a file holding one."""
    if value is None:
        return None
    text = open(value, encoding="utf-8").read() if os.path.isfile(value) else value
    try:
        tools = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"--tools {value[:80]!r}: neither a file nor a JSON list ({e})") from None
    if not isinstance(tools, list):
        raise ValueError(f"--tools {value[:80]!r}: must be a JSON list of tools")
    return tools


def _as_tuple(value: object) -> object:
    return tuple(value) if isinstance(value, list) else value


def _generate(client: Client, args: argparse.Namespace) -> int:
    from jaxinfer.cli.args import sampling_kwargs, sampling_options
    from serving.grpc.convert import structured_message

    if args.token_ids is not None:
        try:
            prompt = [int(t) for t in args.token_ids.split(",") if t.strip()]
        except ValueError:
            raise ValueError(f"--token-ids {args.token_ids!r}: expected comma-separated integers") from None
    elif args.prompt is None:
        raise ValueError("no prompt: pass PROMPT or --token-ids")
    else:
        prompt = args.prompt
    # Every sampling flag, as SamplingParams' fields; a field at SamplingParams' own default stays
    # unset on the wire (a server started --no-penalties accepts the default penalties). The
    # server checks the values (and the logit bias against its vocabulary).
    defaults = {d.name: d.default for d in sampling_options()}
    kwargs = {
        name: value
        for name, value in sampling_kwargs(args).items()
        if value is not None and _as_tuple(value) != _as_tuple(defaults[name])
    }
    if "structured_output" in kwargs:
        kwargs["structured_output"] = structured_message(kwargs["structured_output"])
    if (args.tools or args.tool_choice) and not args.chat:
        raise ValueError("--tools / --tool-choice: only with --chat")
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        stream = client.stream(
            messages=messages,
            timeout=args.timeout,
            tools=_tools_arg(args.tools),
            tool_choice=args.tool_choice,
            lora_adapter=args.lora,
            **kwargs,
        )
    else:
        stream = client.stream(prompt, timeout=args.timeout, lora_adapter=args.lora, **kwargs)
    for msg in stream:
        if args.output_format == "jsonl":
            from google.protobuf import json_format

            print(
                json.dumps(json_format.MessageToDict(msg, preserving_proto_field_name=True), ensure_ascii=False),
                flush=True,
            )
            continue
        for delta in msg.outputs:
            piece = delta.text if delta.text or not delta.token_ids else " ".join(map(str, delta.token_ids)) + " "
            print(piece, end="", flush=True)
    if args.output_format == "text":
        print(flush=True)
    return 0


def _print_message(msg: Message) -> int:
    from google.protobuf import json_format

    print(
        json.dumps(
            json_format.MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True),
            indent=2,
        )
    )
    return 0


_CLIENT_ACTIONS = {
    "generate": _generate,
    "tokenize": lambda c, a: (
        print(json.dumps(c.tokenize(a.text, add_special_tokens=not a.no_special_tokens, timeout=a.timeout))) or 0
    ),
    "detokenize": lambda c, a: print(c.detokenize(a.token_ids, timeout=a.timeout)) or 0,
    "info": lambda c, a: _print_message(c.model_info(timeout=a.timeout)),
    "stats": lambda c, a: _print_message(c.server_stats(timeout=a.timeout)),
    "health": lambda c, a: print(c.health(timeout=a.timeout)) or 0,
}
