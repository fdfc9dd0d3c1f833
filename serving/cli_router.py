"""`jaxinfer serve`'s flags for serving behind a router: the KV events a prefix-aware router
subscribes to (serving/kv_events.py), checked before the model loads."""

from __future__ import annotations

import argparse


def add_router_args(serve: argparse.ArgumentParser) -> None:
    g = serve.add_argument_group(
        "behind a router",
        "Routers read the load (HTTP /get_load, the vllm:* metrics) on their own; prefix-aware ones "
        "(vllm-router --policy kv_aware, llm-d) also subscribe to the KV events.",
    )
    g.add_argument(
        "--kv-events-endpoint",
        default=None,
        metavar="tcp://HOST:PORT",
        help="publish the pages entering and leaving the prefix cache over ZMQ in vLLM's KV event "
        "format (data replica r on PORT + r; HOST * binds every address; default: off)",
    )
    g.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        metavar="tcp://HOST:PORT",
        help="answer replay requests for missed KV event batches here (needs --kv-events-endpoint)",
    )


def router_options(args: argparse.Namespace) -> dict:
    from serving.kv_events import offset_endpoint

    if args.kv_events_replay_endpoint is not None and args.kv_events_endpoint is None:
        raise ValueError("--kv-events-replay-endpoint: needs --kv-events-endpoint")
    for flag in ("--kv-events-endpoint", "--kv-events-replay-endpoint"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            try:
                offset_endpoint(value, 0)
            except ValueError as e:
                raise ValueError(f"{flag} {value}: {str(e).split(': ', 1)[1]}") from None
    return dict(kv_events_endpoint=args.kv_events_endpoint, kv_events_replay_endpoint=args.kv_events_replay_endpoint)
