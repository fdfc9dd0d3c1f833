"""serving: the gRPC batching server and the OpenAI-compatible HTTP API around one jaxinfer Engine
(threads and queues live here only).

    client ──gRPC──► grpc.aio event loop (servicer.py)           engine thread (engine_loop.py)
                      Generate: validate, tokenize (worker)  ──►  commands: SimpleQueue
                      per-call asyncio.Queue  ◄──call_soon_threadsafe── deltas after each step()
                      cancel / deadline / error ──abort──────►   engine.abort: pages freed now

    proto/      jaxinfer.v1 API (jaxinfer.proto) and its committed generated code (regen.py)
    convert.py  wire <-> engine types (structured output too); RequestError names the bad field
    engine_loop.py  the only thread that touches the Engine
    servicer.py the RPC handlers: admission (RESOURCE_EXHAUSTED), streaming, deadlines, isolation
    server.py   InferenceServer life cycle (health, reflection, TLS, graceful stop), BackgroundServer
    auth.py     bearer-token interceptor (constant-time compare)
    limits.py   per-key rate limits (requests/tokens per minute, concurrency), shared by both transports
    request_log.py  one JSON line per finished request (--request-log)
    metrics.py  Prometheus metrics on their own port
    client.py   Client / AsyncClient
    cli.py      `jaxinfer serve` / `jaxinfer client` (entry point group "jaxinfer.cli")
    openai/     the OpenAI-compatible HTTP API (Starlette on uvicorn, same event loop and EngineLoop)

The import direction is serving -> jaxinfer; jaxinfer never imports serving.
"""
