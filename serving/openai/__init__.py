"""The OpenAI-compatible HTTP API, on the same EngineLoop as the gRPC server (one engine, both
transports, one event loop, one shutdown).

    client ──HTTP──► uvicorn (a task of the grpc.aio event loop)
                     Gate (middleware.py): draining 503, API key 401, body size 413, admission
                     app.py routes ──► handlers.py: parse -> inputs.py (SamplingParams; 400 naming
                        the field) -> generation.EngineRequests: EngineLoop.submit, deltas,
                        abort when the client leaves -> outputs.py (OpenAI JSON) / sse.py (chunks)

    protocol.py   request bodies (pydantic)         errors.py   OpenAI's error JSON, status codes
    responses.py  response bodies (pydantic; for the schema)
    schema.py     the OpenAPI schema from those models   docs.py   /openapi.json, /docs (Swagger UI)
    inputs.py     body -> prompt ids + SamplingParams (response_format / guided_* -> StructuredOutput),
                  by sampling_table.py (request field -> SamplingParams field)
    prompts.py    a completion's prompt (text, ids, or lists of either) -> token ids per prompt
    messages.py   chat messages (+ tools, template kwargs) -> the chat template's token ids
    outputs.py    RequestOutput -> responses, chunks    tools.py  tool calls, reasoning in OpenAI's shapes
    sse.py        `data: ...` events, disconnect-aware streaming response
    generation.py one request's engine requests     admission.py in-flight limit + per-key rate limits
    auth.py       API keys (sha256, constant time)  middleware.py  the Gate
    app.py        routes, error handlers            server.py   HttpServer (uvicorn) life cycle

It shares the engine loop, limits, metrics, request log and tool reading with the gRPC
transport through serving's shared modules, and never imports serving.grpc, protobuf or grpc.
"""
