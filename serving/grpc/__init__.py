"""The gRPC transport: the jaxinfer.v1 API over grpc.aio, on the EngineLoop the HTTP API shares.

    client ──gRPC──► grpc.aio event loop (servicer.py)           engine thread (serving.engine_loop)
                      Generate: validate, tokenize (worker)  ──►  commands: SimpleQueue
                      per-call asyncio.Queue  ◄──call_soon_threadsafe── deltas after each step()
                      cancel / deadline / error ──abort──────►   engine.abort: pages freed now

    proto/        jaxinfer.v1 API (jaxinfer.proto) and its committed generated code (regen.py)
    convert.py    wire <-> engine types (structured output too); RequestError names the bad field
    servicer.py   the RPC handlers: admission (RESOURCE_EXHAUSTED), streaming, deadlines, isolation
    streaming.py  one Generate call's queue: waits bounded by the deadline, end statuses (Refused)
    server.py     GrpcServer: the grpc.aio listener (health, reflection, TLS, graceful stop)
    auth.py       bearer-token interceptor (constant-time compare)
    client.py     Client / AsyncClient        client_cli.py  `jaxinfer client`
    client_messages.py  the clients' requests (build_request) and results (Accumulator -> GenerateResult)

Only this package imports protobuf and grpc; serving.openai never imports it (import-linter).
"""
