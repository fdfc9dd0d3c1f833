"""`jaxinfer serve` and `jaxinfer client`, registered through the "jaxinfer.cli" entry point.

    jaxinfer serve [--model PATH] [--port 50051] [--metrics-port 9090] [--tls-cert C --tls-key K]
    JAXINFER_AUTH_TOKEN=secret jaxinfer serve          # or --auth-token-file FILE
    jaxinfer serve --http-port 8000 [--no-grpc]        # + the OpenAI-compatible HTTP API (only)
    JAXINFER_API_KEYS=k1,k2 jaxinfer serve --http-port 8000   # or --api-keys-file FILE
    jaxinfer serve --rate-limit-rpm 60 --rate-limit-tpm 100000 --max-concurrent-per-key 4 \
        --request-log requests.jsonl [--log-prompts]    # per-key limits (both transports), JSON lines
    jaxinfer serve --http-port 8000 --kv-events-endpoint 'tcp://*:5557'   # behind a prefix-aware router
    jaxinfer serve --ray [ADDRESS] --replicas 2 --http-port 8000   # the HTTP API on Ray Serve (ray_serve.py)
    jaxinfer client ...                                # serving/grpc/client_cli.py

`serve` prints one line "listening on HOST:PORT" on stdout once it accepts calls (with the HTTP
API: "listening on HOST:PORT (http://HOST:PORT)", or "listening on http://HOST:PORT" with
--no-grpc) and exits 0 after SIGTERM or SIGINT (in-flight calls get --grace-period seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from serving.cli_router import add_router_args, router_options
from serving.grpc.client_cli import TOKEN_ENV, add_client_parser
from serving.openai.auth import API_KEYS_ENV
from serving.ray_serve import add_ray_args

if TYPE_CHECKING:  # both import JAX: only when a command runs
    from jaxinfer.engine import Engine
    from serving.server import ServerOptions

AddArgs = Callable[[argparse.ArgumentParser], None]


def register(subparsers: argparse._SubParsersAction, add_engine_args: AddArgs, add_sampling_args: AddArgs) -> None:
    serve = subparsers.add_parser("serve", help="run the gRPC batching server")
    add_engine_args(serve)
    serve.set_defaults(compile_in_background=True)  # a server answers once a first request's buckets are in
    g = serve.add_argument_group("server")
    g.add_argument(
        "--no-compile-in-background",
        dest="compile_in_background",
        action="store_false",
        help="compile every step variant before serving the first request (serve's default is "
        "--compile-in-background: serving starts once a first request's buckets are compiled)",
    )
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 or [::] for all)")
    g.add_argument("--port", type=int, default=50051, help="gRPC port (0 = any free port)")
    g.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus /metrics on this port (0 = any free port; default: off)",
    )
    g.add_argument(
        "--metrics-host", default="127.0.0.1", help="address the metrics endpoint listens on (default 127.0.0.1)"
    )
    g.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="calls admitted beyond --max-num-seqs; past it calls get RESOURCE_EXHAUSTED",
    )
    g.add_argument(
        "--auth-token-file",
        default=None,
        help=f"require 'authorization: Bearer <token>' (token: first line of FILE, or ${TOKEN_ENV})",
    )
    g.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve TLS")
    g.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    g.add_argument(
        "--grace-period", type=float, default=10.0, help="seconds in-flight calls get to finish on SIGTERM/SIGINT"
    )
    g.add_argument("--max-message-bytes", type=int, default=4 * 1024 * 1024)
    g.add_argument(
        "--warm-up-only",
        action="store_true",
        help="build the engine (every step variant compiled or read, and kept in the caches), print what "
        "the warm-up did and exit without serving: e.g. in an image build, or before a service starts",
    )
    _add_http_args(serve)
    _add_limit_args(serve)
    add_router_args(serve)
    add_ray_args(serve)
    serve.set_defaults(func=cmd_serve)

    add_client_parser(subparsers, add_sampling_args)


def _add_http_args(serve: argparse.ArgumentParser) -> None:
    h = serve.add_argument_group("OpenAI-compatible HTTP API")
    h.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="serve the OpenAI-compatible HTTP API on this port too (0 = any free port; default: off)",
    )
    h.add_argument("--http-host", default="127.0.0.1", help="address the HTTP API listens on (default 127.0.0.1)")
    h.add_argument("--no-grpc", action="store_true", help="serve only the HTTP API (needs --http-port)")
    h.add_argument("--no-ui", action="store_true", help="do not serve the playground page at /ui of the HTTP API")
    h.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="load and unload LoRA adapters while serving (HTTP /v1/load_lora_adapter, "
        "/v1/unload_lora_adapter; gRPC LoadLoraAdapter, UnloadLoraAdapter; needs --enable-lora)",
    )
    h.add_argument(
        "--served-model-name", default=None, help="the model name clients send (default: the model path's basename)"
    )
    h.add_argument(
        "--api-keys-file",
        default=None,
        help=f"require 'Authorization: Bearer <key>': keys one per line, # comments (or ${API_KEYS_ENV}, "
        "comma-separated; without either, the gRPC token if one is set)",
    )
    h.add_argument(
        "--max-body-bytes",
        type=int,
        default=4 * 1024 * 1024,
        help="largest HTTP request body; larger ones get 413 (default 4 MiB)",
    )
    h.add_argument(
        "--tool-call-parser",
        default="auto",
        metavar="{auto,none,hermes,llama3_json,mistral}",
        help='the format tool calls are read in for tool_choice "auto": auto (the one the chat '
        'template shows; none if it shows none), none (refuse "auto"), or a format',
    )


def _add_limit_args(serve: argparse.ArgumentParser) -> None:
    g = serve.add_argument_group(
        "per-key rate limits and request log (both transports)",
        "A key is an HTTP API key or the gRPC token (the same secret is one key on both); "
        "without auth, all requests share one anonymous key. Past a limit: HTTP 429 / "
        "gRPC RESOURCE_EXHAUSTED with Retry-After. All off by default.",
    )
    g.add_argument("--rate-limit-rpm", type=int, default=None, metavar="N", help="requests per minute per key")
    g.add_argument(
        "--rate-limit-tpm",
        type=int,
        default=None,
        metavar="N",
        help="tokens per minute per key: prompt + max_tokens x n charged at admission, "
        "what was not generated refunded at the end",
    )
    g.add_argument(
        "--max-concurrent-per-key", type=int, default=None, metavar="N", help="generation requests in flight per key"
    )
    g.add_argument(
        "--request-log",
        default=None,
        metavar="FILE",
        help="append a JSON line per finished generation request to FILE ('-': stderr)",
    )
    g.add_argument("--log-prompts", action="store_true", help="--request-log includes prompts and outputs")


def _limit_options(args: argparse.Namespace) -> dict:
    """ServerOptions' rate_limits / request_log / log_prompts, checked before the model loads."""
    from serving.limits import RateLimits

    for flag in ("--rate-limit-rpm", "--rate-limit-tpm", "--max-concurrent-per-key"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: must be >= 1")
    if args.log_prompts and args.request_log is None:
        raise ValueError("--log-prompts: needs --request-log")
    if args.request_log not in (None, "-"):
        try:
            open(args.request_log, "a", encoding="utf-8").close()
        except OSError as e:
            raise ValueError(f"--request-log {args.request_log}: {e.strerror or e}") from None
    limits = RateLimits(args.rate_limit_rpm, args.rate_limit_tpm, args.max_concurrent_per_key)
    return dict(rate_limits=limits, request_log=args.request_log, log_prompts=args.log_prompts)


# --- serve --------------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    from jaxinfer.cli.args import check_file, llm_options, make_llm
    from jaxinfer.cli.warm_up import print_warm_up
    from serving.grpc.auth import read_token
    from serving.openai.auth import read_api_keys
    from serving.server import ServerOptions

    for flag in ("--auth-token-file", "--tls-cert", "--tls-key", "--api-keys-file"):  # before the model loads
        check_file(flag, getattr(args, flag[2:].replace("-", "_")))
    for flag, port in (("--port", args.port), ("--metrics-port", args.metrics_port), ("--http-port", args.http_port)):
        if port is not None and not 0 <= port <= 65535:
            raise ValueError(f"{flag} {port}: must be in [0, 65535]")
    if args.no_grpc and args.http_port is None:
        raise ValueError("--no-grpc: needs --http-port (there would be nothing to serve)")
    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes {args.max_body_bytes}: must be >= 1")
    _check_parsers(args)
    options = ServerOptions(
        host=args.host,
        port=None if args.no_grpc else args.port,
        max_waiting=args.max_waiting,
        auth_token=read_token(os.environ.get(TOKEN_ENV) or None, args.auth_token_file),
        tls_cert_file=args.tls_cert,
        tls_key_file=args.tls_key,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        grace_period_s=args.grace_period,
        max_message_bytes=args.max_message_bytes,
        http_port=args.http_port,
        http_host=args.http_host,
        ui=not args.no_ui,
        lora_updates=args.allow_runtime_lora_updating,
        served_model_name=args.served_model_name,
        max_body_bytes=args.max_body_bytes,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        api_keys=tuple(read_api_keys(args.api_keys_file, os.environ.get(API_KEYS_ENV) or None)),
        **_limit_options(args),
        **router_options(args),
    )
    if args.ray is not None:  # the HTTP API from replicas on a Ray cluster (serving/ray_serve.py)
        from serving.ray_serve import serve_on_ray

        return serve_on_ray(args, options, llm_options(args))
    signal.signal(signal.SIGTERM, _terminated_while_starting)
    if args.warm_up_only:  # everything compiled (or read) and kept before it exits
        args.compile_in_background = False
    start, llm = time.perf_counter(), make_llm(args)
    if args.warm_up_only:
        return print_warm_up(llm, start, "text")
    engine = llm.engine
    try:
        return asyncio.run(_serve(engine, options))
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _check_parsers(args: argparse.Namespace) -> None:
    """--tool-call-parser and --reasoning-parser name known formats (before the model loads)."""
    from jaxinfer.cli.args import check_reasoning_parser
    from jaxinfer.tokenizer.tool_calls import tool_call_parser

    check_reasoning_parser(args)
    if args.tool_call_parser in ("auto", "none"):
        return
    try:
        tool_call_parser(args.tool_call_parser)
    except ValueError as e:  # "tool_call_parser='x': unknown; choose one of ..."
        raise ValueError(f"--tool-call-parser {args.tool_call_parser}: {str(e).split(': ', 1)[1]}") from None


def _terminated_while_starting(signum, frame):
    raise SystemExit(0)  # nothing was served yet; the handler of _serve takes over once it is


async def _serve(engine: Engine, options: ServerOptions) -> int:
    from serving.server import InferenceServer

    server = InferenceServer(engine, options)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
    except BaseException:
        await asyncio.to_thread(server.engine_loop.stop)
        server.request_log.close()
        raise
    metrics = f" (metrics on {options.metrics_host}:{server.metrics_port})" if server.metrics_port else ""
    if server.http is None:
        print(f"listening on {server.address}{metrics}", flush=True)
    elif options.port is None:
        print(f"listening on {server.http.url}{metrics}", flush=True)
    else:
        print(f"listening on {server.address} ({server.http.url}){metrics}", flush=True)
    await stop.wait()
    print(f"shutting down (grace period {options.grace_period_s:g} s)", file=sys.stderr, flush=True)
    await server.stop()
    return 0
