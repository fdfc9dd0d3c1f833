"""jaxinfer inside other systems' runtimes (optional extras, imported only by those who use them).

    feeder.py     one engine fed by many callers from a thread of its own (what every replica runs)
    ray.py        Ray Data: build_processor(JaxinferProcessorConfig(...)), replicas as actors
    ray_batch.py  `jaxinfer batch --ray`: the JSONL job through Ray Data, exactly once across kills

Ray Serve, which serves the HTTP API, is `serving.ray_serve` (the serving package sits above this one).
"""
