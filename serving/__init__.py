"""serving: the gRPC batching server and the OpenAI-compatible HTTP API around one jaxinfer Engine
(threads and queues live here only).

    cli.py         `jaxinfer serve` / `jaxinfer client` (entry point group "jaxinfer.cli")
    server.py      InferenceServer: one engine behind both transports, their life cycle;
                   BackgroundServer (its own thread, for tests, benchmarks, synchronous code)
    grpc/          the jaxinfer.v1 gRPC API: proto, servicer, GrpcServer, client, `jaxinfer client`
    openai/        the OpenAI-compatible HTTP API (Starlette on uvicorn, same event loop), its
                   OpenAPI schema and docs page
    shared by both transports (no protobuf, no HTTP):
    engine_loop.py the only thread that touches the Engine; merge_deltas for slow readers
    model_limits.py  ModelLimits, check_params: what a request is checked against
    sampling_fields.py  the transports' tables of request fields -> SamplingParams fields
    tools.py       tool calling and reasoning, read the same way on both transports
    limits.py      per-key rate limits (requests/tokens per minute, concurrency)
    request_log.py one JSON line per finished request (--request-log)
    metrics.py     Prometheus metrics on their own port and at the HTTP API's /metrics
    errors.py      RequestError: a client's mistake, naming the field

Imports run cli -> server -> {grpc, openai} -> the shared modules (import-linter contracts in
pyproject.toml); grpc and openai never import each other. serving -> jaxinfer; jaxinfer never
imports serving.
"""
