"""The engine's load under the Prometheus names routers and autoscalers read (vLLM's), beside
the `jaxinfer_*` ones (serving/metrics.py registers both in one registry):

    vllm:num_requests_running, vllm:num_requests_waiting        gauges: sequences in the engine
    vllm:kv_cache_usage_perc, vllm:gpu_cache_usage_perc          gauge: KV pages in use, 0 .. 1
                                                                 (the second: the older name)
    vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total   counters: prompt tokens
    vllm:num_preemptions_total                                   counter
    vllm:cache_config_info                                       1, its labels the KV cache's
                                                                 page size and page counts
    vllm:lora_requests_info                                      the time of the last update, its
                                                                 labels the adapters running and
                                                                 waiting (with LoRA on)

Every series carries `model_name` (the served name) and `engine` (the data replica's index,
"0" summed over replicas), as vLLM labels them; llm-d's scheduler and vllm-router's program
scheduling group by those labels.
"""

from __future__ import annotations

import time
from typing import Any

import prometheus_client as prom

LABELS = ("model_name", "engine")


class VllmMetrics:
    def __init__(self, registry: prom.CollectorRegistry, model_name: str):
        self.model_name = model_name
        r = registry
        self.running = prom.Gauge(
            "vllm:num_requests_running", "requests in model execution batches", LABELS, registry=r
        )
        self.waiting = prom.Gauge("vllm:num_requests_waiting", "requests waiting to be processed", LABELS, registry=r)
        self.kv_usage = prom.Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent", LABELS, registry=r
        )
        self.gpu_usage = prom.Gauge(
            "vllm:gpu_cache_usage_perc", "KV-cache usage, 1 means 100 percent (the older name)", LABELS, registry=r
        )
        self.queries = prom.Counter("vllm:prefix_cache_queries", "prompt tokens looked up", LABELS, registry=r)
        self.hits = prom.Counter("vllm:prefix_cache_hits", "prompt tokens found cached", LABELS, registry=r)
        self.preemptions = prom.Counter("vllm:num_preemptions", "cumulative preemptions", LABELS, registry=r)
        self.cache_info = prom.Gauge(
            "vllm:cache_config_info",
            "information of the KV cache config",
            [*LABELS, "block_size", "num_gpu_blocks", "num_cpu_blocks", "cache_dtype", "enable_prefix_caching"],
            registry=r,
        )
        self.lora_info = prom.Gauge(
            "vllm:lora_requests_info",
            "running and waiting LoRA adapters",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=r,
        )
        self._seen = {"queries": 0, "hits": 0, "preemptions": 0}
        self._described = False

    def on_step(self, engine: Any, stats: dict) -> None:
        """After each step (the engine thread): the gauges set, the counters advanced."""
        labels = {"model_name": self.model_name, "engine": "0"}
        if not self._described:
            self._describe(engine, labels)
        self.running.labels(**labels).set(stats["running"])
        self.waiting.labels(**labels).set(stats["waiting"])
        self.kv_usage.labels(**labels).set(stats["kv_cache_usage"])
        self.gpu_usage.labels(**labels).set(stats["kv_cache_usage"])
        caches = [r.kv_cache for r in engine.replicas]
        for key, counter, value in (
            ("queries", self.queries, sum(c.prefix_cache_queries for c in caches)),
            ("hits", self.hits, sum(c.prefix_cache_hits for c in caches)),
            ("preemptions", self.preemptions, engine.num_preemptions),
        ):
            if value > self._seen[key]:
                counter.labels(**labels).inc(value - self._seen[key])
            self._seen[key] = value
        if "lora_running" in stats and engine.lora is not None:
            self.lora_info.clear()
            self.lora_info.labels(
                max_lora=str(engine.config.lora.max_loras),
                waiting_lora_adapters=",".join(sorted(n for n, k in stats["lora_waiting"].items() if k)),
                running_lora_adapters=",".join(sorted(n for n, k in stats["lora_running"].items() if k)),
            ).set(time.time())

    def _describe(self, engine: Any, labels: dict[str, str]) -> None:
        cache = engine.config.cache
        self.cache_info.labels(
            **labels,
            block_size=str(engine.worker.page_size),
            num_gpu_blocks=str(engine.kv_cache.num_usable_pages),
            num_cpu_blocks=str(engine.worker.host_pages),
            cache_dtype=cache.kv_cache_dtype,
            enable_prefix_caching=str(cache.enable_prefix_caching),
        ).set(1)
        self._described = True
