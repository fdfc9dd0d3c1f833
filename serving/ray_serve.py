"""Ray Serve: the OpenAI HTTP API of `jaxinfer serve --http-port` in a Serve deployment of N replicas.

    from serving.ray_serve import build_app
    app = build_app("/models/llama", {"max_num_seqs": 64}, num_replicas=2)          # or
    app = build_app("/models/llama", {...}, autoscaling={"min_replicas": 1, "max_replicas": 8})
    ray.serve.run(app, route_prefix="/")

    jaxinfer serve --ray [ADDRESS] --replicas 2 [--max-replicas 8] --http-port 8000 [engine flags]

Each replica is a Serve actor holding one engine and the same ASGI app `serve --http-port` serves
(routes, API keys, limits, errors: serving/openai), bound late (`__serve_build_asgi_app__`), so
there is nothing to keep in step. Serve's proxy routes requests to replicas (power of two choices
on their queues) and, with `autoscaling`, scales them on ongoing requests (target: max_num_seqs
per replica). Serve asks each replica's `check_health`, which fails once its engine loop died.

Metrics: each replica's Prometheus registry (jaxinfer_* and the vllm:* names) is copied into Ray's
metrics every few seconds, tagged with the replica's id; Ray's metrics agent on every node exports
them (prefixed `ray_`, vLLM's names with `_` for `:`) on its metrics export port, where Ray's
Prometheus service discovery finds them. /metrics still answers for the replica a request reaches.
"""

from __future__ import annotations

import argparse
import logging
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from ray.serve import Application

    from serving.server import InferenceServer, ServerOptions

logger = logging.getLogger(__name__)

APP_NAME = "jaxinfer"
METRICS_PERIOD_S = 5.0


class RayMetricsBridge:
    """Copies a Prometheus registry's jaxinfer_* and vllm:* samples into Ray gauges every `period_s`
    (counters and histograms by their sample names: _total, _bucket{le}, _sum, _count)."""

    def __init__(self, registry: CollectorRegistry, replica: str, period_s: float = METRICS_PERIOD_S):
        self.registry, self.replica, self.period_s = registry, replica, period_s
        self._gauges: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxinfer-ray-metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.copy()
            except Exception:  # noqa: BLE001 - metrics never take a replica down
                logger.exception("copying metrics to Ray failed")

    def copy(self) -> None:
        from ray.util.metrics import Gauge

        for family in self.registry.collect():
            for sample in family.samples:
                if not sample.name.startswith(("jaxinfer_", "vllm:")) or sample.name.endswith("_created"):
                    continue
                gauge = self._gauges.get(sample.name)
                if gauge is None:  # Ray's names take no ':' (vllm:num_requests_running -> vllm_num_...)
                    keys = (*sorted(sample.labels), "replica")
                    name = sample.name.replace(":", "_")
                    gauge = self._gauges[sample.name] = Gauge(name, family.documentation, tag_keys=keys)
                gauge.set(sample.value, tags={**sample.labels, "replica": self.replica})

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.period_s + 1)


class JaxinferReplica:
    """One engine and the HTTP API's app over it (the body of the Serve deployment)."""

    def __init__(self, model: str | None, engine_kwargs: dict[str, Any], options: ServerOptions):
        from ray import serve

        from jaxinfer.llm import LLM
        from serving.server import InferenceServer

        engine = LLM(model, **engine_kwargs).engine
        self.server: InferenceServer = InferenceServer(engine, options)
        if self.server.http is None:
            raise ValueError("the deployment serves the HTTP API: its ServerOptions need an http_port")
        self.server.engine_loop.start()
        replica = serve.get_replica_context().replica_id.unique_id
        self.metrics = RayMetricsBridge(self.server.metrics.registry, replica)

    def __serve_build_asgi_app__(self):
        assert self.server.http is not None  # checked in __init__
        return self.server.http.gate

    def check_health(self) -> None:
        if not self.server.engine_loop.is_alive:
            raise RuntimeError("the engine loop has stopped")

    def __del__(self):
        self.metrics.close()
        self.server.engine_loop.stop()


def build_app(
    model: str | None = None,
    engine_kwargs: dict[str, Any] | None = None,
    *,
    num_replicas: int = 1,
    autoscaling: dict[str, Any] | None = None,
    options: ServerOptions | None = None,
    ray_actor_options: dict[str, Any] | None = None,
) -> Application:
    """The deployment, bound: `num_replicas` engines, or Serve's `autoscaling_config` (its
    target_ongoing_requests defaults to max_num_seqs). `options`: the HTTP API's ServerOptions
    (API keys, limits, parsers, served name; the ports are Serve's). `ray_actor_options`: what
    one replica holds, e.g. {"num_cpus": 4, "resources": {"TPU": 4}} or {"num_gpus": 1}."""
    import dataclasses

    from ray import serve

    from jaxinfer.config import EngineConfig
    from serving.server import ServerOptions

    engine_kwargs = dict(engine_kwargs or {})
    try:  # unknown or bad options fail here, not in every replica
        config = EngineConfig(model=model, **engine_kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"engine_kwargs: {e}") from None
    options = dataclasses.replace(options or ServerOptions(port=None, http_port=0), port=None, http_port=0)
    deployment_options: dict[str, Any] = {
        "name": APP_NAME,
        "ray_actor_options": ray_actor_options or {"num_cpus": 1},
        "max_ongoing_requests": 4 * config.scheduler.max_num_seqs,
        "health_check_period_s": 10,
    }
    if autoscaling is not None:
        deployment_options["autoscaling_config"] = {
            "target_ongoing_requests": config.scheduler.max_num_seqs,
            **autoscaling,
        }
    else:
        deployment_options["num_replicas"] = num_replicas
    deployment = serve.deployment(**deployment_options)(serve.ingress()(JaxinferReplica))
    return deployment.bind(model, engine_kwargs, options)


def app_builder(args: dict[str, Any]) -> Application:
    """Ray Serve's application builder (`serve run serving.ray_serve:app_builder model=...`, or the
    import_path of a `serve deploy` config / a KubeRay RayService): `args` holds build_app's
    arguments (model, engine_kwargs, num_replicas, autoscaling, ray_actor_options) and `server`, a
    mapping of ServerOptions fields (api_keys, served_model_name, max_waiting, ...)."""
    from serving.server import ServerOptions

    args = dict(args)
    unknown = set(args) - {"model", "engine_kwargs", "num_replicas", "autoscaling", "ray_actor_options", "server"}
    if unknown:
        raise ValueError(f"app_builder: unknown arguments {sorted(unknown)}")
    server = dict(args.pop("server", None) or {})
    if "api_keys" in server:
        server["api_keys"] = tuple(server["api_keys"])
    try:
        options = ServerOptions(**{"port": None, "http_port": 0, **server})
    except TypeError as e:
        raise ValueError(f"app_builder: server: {e}") from None
    return build_app(
        args.get("model"),
        args.get("engine_kwargs"),
        num_replicas=int(args.get("num_replicas", 1)),
        autoscaling=args.get("autoscaling"),
        options=options,
        ray_actor_options=args.get("ray_actor_options"),
    )


def add_ray_args(serve: argparse.ArgumentParser) -> None:
    from jaxinfer.cli.args import add_ray_args as add_common

    g = add_common(
        serve,
        "serve the HTTP API from a Ray Serve deployment (Serve's proxy on --http-host/--http-port)",
        "engine replicas (with --max-replicas: the fewest)",
    )
    g.add_argument(
        "--max-replicas",
        type=int,
        default=None,
        help="scale between --replicas and this many on ongoing requests (--max-num-seqs per replica)",
    )


def serve_on_ray(args: argparse.Namespace, options: ServerOptions, engine_kwargs: dict[str, Any]) -> int:
    """`jaxinfer serve --ray`: the deployment on the cluster, Serve's proxy on --http-host/--http-port;
    prints "listening on URL" once every replica is up, removes the application on SIGTERM/SIGINT."""
    import signal

    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise ValueError(f"--ray needs Ray Serve: pip install 'jaxinfer[ray]' ({e})") from None
    from jaxinfer.integrations.ray import check_resources, resources_from_json

    if args.max_replicas is not None and args.max_replicas < args.replicas:
        raise ValueError(f"--max-replicas {args.max_replicas}: must be >= --replicas {args.replicas}")
    if args.replicas < 1:
        raise ValueError(f"--replicas {args.replicas}: must be >= 1")
    if options.metrics_port is not None:
        raise ValueError("--metrics-port: not with --ray (each replica's metrics go to Ray's metrics export port)")
    if options.kv_events_endpoint is not None:
        raise ValueError(
            "--kv-events-endpoint: not with --ray (Serve's proxy routes the requests, not a KV-aware router)"
        )
    resources = resources_from_json("--ray-resources", args.ray_resources)
    actor_options: dict[str, Any] = {"num_cpus": resources.pop("CPU", 1.0), "num_gpus": resources.pop("GPU", 0.0)}
    if resources:
        actor_options["resources"] = resources
    ray.init(address=None if args.ray == "auto" else args.ray, log_to_driver=False)
    check_resources({"CPU": actor_options["num_cpus"], "GPU": actor_options["num_gpus"], **resources}, args.replicas)
    autoscaling = None
    if args.max_replicas is not None:
        autoscaling = {"min_replicas": args.replicas, "max_replicas": args.max_replicas}
    model = engine_kwargs.pop("model", None)
    app = build_app(
        model,
        engine_kwargs,
        num_replicas=args.replicas,
        autoscaling=autoscaling,
        options=options,
        ray_actor_options=actor_options,
    )
    port = 8000 if options.http_port is None else options.http_port
    serve.start(http_options={"host": options.http_host, "port": port})
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    serve.run(app, name=APP_NAME, route_prefix="/")
    print(f"listening on http://{options.http_host}:{port} (Ray Serve, {args.replicas} replicas)", flush=True)
    stop.wait()
    serve.delete(APP_NAME)
    if not serve.status().applications:  # Serve was ours alone: its proxy goes too (it keeps its port)
        serve.shutdown()
    return 0
