"""Prometheus metrics of one server, in their own registry (several servers can share a process,
as in the tests), served over HTTP on their own port and at the HTTP API's /metrics.

Written by the engine thread (per-step gauges from `Engine.stats()`, per-request histograms when a
request finishes) and by the event loop (refusals: rejected requests, rate limits, HTTP statuses).
prometheus_client's metrics are thread-safe; scrapes read them from the HTTP server's thread.
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING, Any

import prometheus_client as prom

from serving.vllm_metrics import VllmMetrics

if TYPE_CHECKING:  # the engine imports JAX; metrics are host-side
    from jaxinfer.engine import Engine
    from jaxinfer.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_THROUGHPUT_WINDOW_S = 10.0


class ServerMetrics:
    def __init__(self, model_name: str = ""):
        """`model_name`: the served name, the `model_name` label of the `vllm:*` series."""
        self.registry = prom.CollectorRegistry()
        self.vllm = VllmMetrics(self.registry, model_name)  # the names routers read (vllm_metrics.py)
        self._define_latencies(self.registry)
        self._define_requests(self.registry)
        self._define_engine_state(self.registry)
        self._define_spec_decode(self.registry)
        self._define_lora(self.registry)
        self._define_kv_transfer(self.registry)
        self._window: collections.deque[tuple[float, int]] = collections.deque()
        self._seen = {
            "preemptions": 0,
            "queries": 0,
            "hits": 0,
            "host_hits": 0,
            "swapped": 0,
            "lora_loads": 0,
            **dict.fromkeys(self.spec_counters, 0),
            **dict.fromkeys(self.transfer_counters, 0),
        }
        self._http: Any = None  # prometheus_client's WSGI server once serve() started one
        self._held_read = False

    def _define_lora(self, r: prom.CollectorRegistry) -> None:
        """LoRA adapters (when the engine serves them): sequences per adapter, adapters known and
        on the device, adapters written into a device slot since start-up."""
        self.lora_running = prom.Gauge(
            "jaxinfer_lora_requests_running", "sequences running under each LoRA adapter", ["adapter"], registry=r
        )
        self.lora_waiting = prom.Gauge(
            "jaxinfer_lora_requests_waiting", "sequences waiting under each LoRA adapter", ["adapter"], registry=r
        )
        self.lora_adapters = prom.Gauge("jaxinfer_lora_adapters", "LoRA adapters the server knows", registry=r)
        self.lora_on_device = prom.Gauge(
            "jaxinfer_lora_adapters_on_device", "LoRA adapters in a device slot", registry=r
        )
        self.lora_loads = prom.Counter(
            "jaxinfer_lora_adapter_loads", "LoRA adapters written into a device slot", registry=r
        )
        self._lora_labels: set[str] = set()

    def _on_lora(self, stats: dict) -> None:
        names = set(stats["lora_running"]) | set(stats["lora_waiting"])
        for gone in self._lora_labels - names:  # unloaded: its series end
            self.lora_running.remove(gone)
            self.lora_waiting.remove(gone)
        self._lora_labels = names
        for name in names:
            self.lora_running.labels(adapter=name).set(stats["lora_running"].get(name, 0))
            self.lora_waiting.labels(adapter=name).set(stats["lora_waiting"].get(name, 0))
        self.lora_adapters.set(stats["lora_adapters"])
        self.lora_on_device.set(stats["lora_adapters_on_device"])
        self.lora_loads.inc(max(0, stats["lora_loads"] - self._seen["lora_loads"]))
        self._seen["lora_loads"] = stats["lora_loads"]

    def _define_latencies(self, r: prom.CollectorRegistry) -> None:
        """Per-request histograms, observed when a request finishes (on_finished)."""
        self.ttft = prom.Histogram(
            "jaxinfer_time_to_first_token_seconds", "arrival to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = prom.Histogram(
            "jaxinfer_inter_token_latency_seconds", "between two streamed tokens", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.e2e = prom.Histogram(
            "jaxinfer_e2e_request_latency_seconds", "arrival to last token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue = prom.Histogram(
            "jaxinfer_request_queue_time_seconds", "arrival to first scheduled", buckets=_LATENCY_BUCKETS, registry=r
        )

    def _define_requests(self, r: prom.CollectorRegistry) -> None:
        """Tokens and requests: finished ones (engine thread), refused ones and HTTP statuses (event loop)."""
        self.prompt_tokens = prom.Counter("jaxinfer_prompt_tokens", "prompt tokens of completed requests", registry=r)
        self.generation_tokens = prom.Counter("jaxinfer_generation_tokens", "generated tokens", registry=r)
        self.requests = prom.Counter(
            "jaxinfer_requests", "finished samples (n per request) by finish reason", ["finish_reason"], registry=r
        )
        self.rejected = prom.Counter(
            "jaxinfer_rejected_requests", "requests refused by status code", ["code"], registry=r
        )
        self.rate_limited = prom.Counter(
            "jaxinfer_rate_limited",
            "requests refused by a per-key rate limit (limit: rpm, tpm, concurrent)",
            ["limit"],
            registry=r,
        )
        self.http_requests = prom.Counter(
            "jaxinfer_http_requests", "HTTP API responses by route and status", ["route", "status"], registry=r
        )
        self.throughput = prom.Gauge(
            "jaxinfer_generation_tokens_per_second",
            f"generated tokens per second over the last {_THROUGHPUT_WINDOW_S:g} s",
            registry=r,
        )

    def _define_kv_transfer(self, r: prom.CollectorRegistry) -> None:
        """Disaggregated prefill/decode: KV pages offered to and pulled from other servers."""
        self.transfer_counters = {
            f"kv_transfer_{name}": prom.Counter(f"jaxinfer_kv_transfer_{name}", doc, registry=r)
            for name, doc in (
                ("pulls", "prompts whose KV pages this server pulled from a prefill server"),
                ("pages_pulled", "KV pages pulled from prefill servers"),
                ("recomputed", "prompts whose KV pages did not come (computed here instead)"),
                ("offers", "prompts computed here whose KV pages were held for a decode server"),
                ("pages_offered", "KV pages held for decode servers"),
                ("offers_expired", "held KV pages no decode server pulled in time"),
            )
        }
        self.transfer_held = prom.Gauge(
            "jaxinfer_kv_transfer_offers_held", "prompts' KV pages held for a decode server now", registry=r
        )

    def _define_engine_state(self, r: prom.CollectorRegistry) -> None:
        """The engine's state after each step (on_step): queues, KV pages, preemptions, prefix cache."""
        self.running = prom.Gauge("jaxinfer_num_requests_running", "sequences running in the engine", registry=r)
        self.waiting = prom.Gauge("jaxinfer_num_requests_waiting", "sequences waiting in the engine", registry=r)
        self.kv_usage = prom.Gauge("jaxinfer_kv_cache_usage_ratio", "fraction of KV pages in use", registry=r)
        self.kv_free = prom.Gauge("jaxinfer_kv_cache_free_pages", "free KV pages", registry=r)
        self.preemptions = prom.Counter("jaxinfer_preemptions", "sequences preempted", registry=r)
        self.prefix_queries = prom.Counter("jaxinfer_prefix_cache_queries", "prompt tokens looked up", registry=r)
        self.prefix_hits = prom.Counter("jaxinfer_prefix_cache_hits", "prompt tokens served from the cache", registry=r)
        self.prefix_host_hits = prom.Counter(
            "jaxinfer_prefix_cache_host_hits", "of those, tokens whose pages the host tier kept", registry=r
        )
        self.preemptions_swapped = prom.Counter(
            "jaxinfer_preemptions_swapped", "preemptions whose pages went to the host tier (not recomputed)", registry=r
        )
        self.kv_host_usage = prom.Gauge(
            "jaxinfer_kv_host_cache_usage_ratio", "fraction of the host tier's KV pages holding a page", registry=r
        )
        self.variants_ready = prom.Gauge("jaxinfer_step_variants_ready", "step variants compiled and ready", registry=r)
        self.variants_total = prom.Gauge(
            "jaxinfer_step_variants_total", "step variants the engine compiles", registry=r
        )

    def watch_compiles(self, engine: Engine) -> None:
        """The step's variants ready and in all, read from `engine` at each scrape (with
        compile_in_background the ready count grows while the server serves; otherwise both are
        the warm-up's count)."""
        self.variants_ready.set_function(lambda: engine.worker.compile_progress()[0])
        self.variants_total.set_function(lambda: engine.worker.compile_progress()[1])

    def _define_spec_decode(self, r: prom.CollectorRegistry) -> None:
        """Speculative decoding (when the engine has it on): totals since start-up."""
        self.spec_counters = {
            key: prom.Counter(f"jaxinfer_spec_decode_{name}", doc, registry=r)
            for key, name, doc in (
                ("spec_draft_tokens", "draft_tokens", "draft tokens verified"),
                ("spec_accepted_tokens", "accepted_tokens", "draft tokens the target accepted"),
                ("spec_verify_steps", "verify_steps", "verify steps, counted per sequence with drafts"),
            )
        }
        self.spec_acceptance = prom.Gauge(
            "jaxinfer_spec_decode_acceptance_rate", "accepted / draft tokens since start-up", registry=r
        )
        self.spec_mean_length = prom.Gauge(
            "jaxinfer_spec_decode_mean_accepted_length",
            "tokens emitted per verify step (accepted drafts + 1) since start-up",
            registry=r,
        )

    # --- engine thread --------------------------------------------------------------------------
    def on_tokens(self, count: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if count:
            self.generation_tokens.inc(count)
            self._window.append((now, count))
        while self._window and self._window[0][0] < now - _THROUGHPUT_WINDOW_S:
            self._window.popleft()
        self.throughput.set(sum(c for _, c in self._window) / _THROUGHPUT_WINDOW_S)

    def on_finished(self, out: RequestOutput) -> None:
        for c in out.outputs:
            self.requests.labels(finish_reason=c.finish_reason or "unknown").inc()
        if any(c.finish_reason == "abort" for c in out.outputs):
            return  # cancelled or timed out: its latencies say nothing about the server's speed
        m = out.metrics
        for hist, value in ((self.ttft, m.time_to_first_token), (self.e2e, m.e2e_latency), (self.queue, m.queue_time)):
            if value is not None:
                hist.observe(value)
        for gap in m.inter_token_latencies:
            self.itl.observe(gap)
        self.prompt_tokens.inc(out.usage.prompt_tokens)

    def on_step(self, engine: Engine, stats: dict | None = None) -> None:
        """`stats`: engine.stats() after the step, when the caller has it already."""
        stats = engine.stats() if stats is None else stats
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        self.kv_usage.set(stats["kv_cache_usage"])
        self.kv_free.set(stats["kv_pages_free"])
        kv_cache = engine.kv_cache
        for key, counter, value in (
            ("preemptions", self.preemptions, engine.num_preemptions),
            ("queries", self.prefix_queries, kv_cache.prefix_cache_queries),
            ("hits", self.prefix_hits, kv_cache.prefix_cache_hits),
            ("host_hits", self.prefix_host_hits, stats.get("prefix_cache_host_hits", 0)),
            ("swapped", self.preemptions_swapped, stats.get("preemptions_swapped", 0)),
        ):
            if value > self._seen[key]:
                counter.inc(value - self._seen[key])
            self._seen[key] = value
        if "kv_host_pages_total" in stats:
            self.kv_host_usage.set(stats["kv_host_pages_used"] / stats["kv_host_pages_total"])
        if "spec_draft_tokens" in stats:
            for key, counter in self.spec_counters.items():
                counter.inc(max(0, stats[key] - self._seen[key]))
                self._seen[key] = stats[key]
            self.spec_acceptance.set(stats["spec_acceptance_rate"])
            self.spec_mean_length.set(stats["spec_mean_accepted_length"])
        if "lora_running" in stats:
            self._on_lora(stats)
        for key, counter in self.transfer_counters.items():
            counter.inc(max(0, stats.get(key, 0) - self._seen[key]))
            self._seen[key] = stats.get(key, 0)
        if not self._held_read:  # read at each scrape: offers end between steps (pulled, expired)
            self.transfer_held.set_function(lambda: engine.disagg.stats()["kv_transfer_offers_held"])
            self._held_read = True
        self.vllm.on_step(engine, stats)

    # --- HTTP -----------------------------------------------------------------------------------
    def exposition(self) -> tuple[bytes, str]:
        """The Prometheus text of this registry and its content type (for the HTTP API's /metrics)."""
        return prom.generate_latest(self.registry), prom.CONTENT_TYPE_LATEST

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Starts the /metrics HTTP server (port 0 = any free port); returns the port."""
        self._http, _ = prom.start_http_server(port, addr=host, registry=self.registry)
        return self._http.server_port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
