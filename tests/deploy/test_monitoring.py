"""deploy/monitoring/: the Grafana dashboard queries only metrics (and labels) that a server
exports, and its Prometheus and Grafana files hang together."""

import json
import re
from pathlib import Path

import prometheus_client as prom
import pytest
import yaml

from serving.metrics import ServerMetrics

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "jaxinfer.json"
# The samples a histogram family exposes (the classic text format names counters' samples, and
# each `_created`, on TYPE lines of their own).
HISTOGRAM_SAMPLES = ("_bucket", "_sum", "_count")
SUFFIX = re.compile(r"_(total|created|bucket|sum|count)$")
# Labels PromQL or Prometheus add: histogram buckets, the scrape target.
IMPLIED_LABELS = {"le", "instance", "job"}


def exported() -> dict[str, set[str]]:
    """Sample name -> its label names, for every metric a server's registry exposes (names and
    kinds read from the exposition text the server serves at /metrics)."""
    metrics = ServerMetrics()
    text = prom.generate_latest(metrics.registry).decode()
    kinds = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M))
    values = [*vars(metrics).values(), *(v for d in vars(metrics).values() if isinstance(d, dict) for v in d.values())]
    wrappers = [v for v in values if isinstance(v, prom.metrics.MetricWrapperBase)]
    labels = {w._name: set(w._labelnames) for w in wrappers}  # noqa: SLF001 -- prometheus_client keeps them there
    names = {n + s for n, kind in kinds.items() for s in (HISTOGRAM_SAMPLES if kind == "histogram" else ("",))}
    return {n: labels.get(SUFFIX.sub("", n), set()) for n in names}


def panels() -> list[dict]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def queries() -> list[str]:
    return [t["expr"] for p in panels() for t in p["targets"]]


def test_every_metric_the_dashboard_queries_is_exported():
    names = exported()
    assert "jaxinfer_time_to_first_token_seconds_bucket" in names  # the reading above works
    used = {m for expr in queries() for m in re.findall(r"\bjaxinfer_\w+", expr)}
    assert used, "the dashboard queries no jaxinfer metric"
    assert not used - names.keys(), f"queried but not exported: {sorted(used - names.keys())}"
    # Every family the server exports has a panel, so a new metric gets a place on the dashboard;
    # the vllm:* families are the same figures under the names routers read (serving/vllm_metrics.py).
    families = {SUFFIX.sub("", n) for n in names if not n.startswith("vllm:")}
    assert {SUFFIX.sub("", n) for n in names if n.startswith("vllm:")} >= {"vllm:kv_cache_usage_perc"}
    shown = {SUFFIX.sub("", n) for n in used}
    assert not families - shown, f"exported but on no panel: {sorted(families - shown)}"


def test_every_label_the_dashboard_groups_by_belongs_to_its_metrics():
    names = exported()
    for expr in queries():
        metrics = re.findall(r"\bjaxinfer_\w+", expr)
        known = set().union(*(names[m] for m in metrics)) | IMPLIED_LABELS
        grouped = {label.strip() for group in re.findall(r"by \(([^)]*)\)", expr) for label in group.split(",")}
        assert grouped <= known, f"{expr!r} groups by {sorted(grouped - known)}"


def test_the_latency_histograms_load_and_refusals_have_panels():
    titles = {p["title"] for p in panels()}
    for title in (
        "Time to first token",
        "Inter-token latency",
        "End-to-end request latency",
        "Requests in the engine",
        "KV cache use",
        "Prefix cache hit rate",
        "Draft acceptance",
        "Rate-limit refusals",
    ):
        assert title in titles


def test_the_dashboard_is_well_formed():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "instance"} <= variables
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
    for p in panels():
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            assert '{instance=~"$instance"}' in t["expr"], f"{t['expr']!r} ignores the Server variable"


@pytest.mark.parametrize(
    "path",
    [
        "prometheus.yml",
        "docker-compose.yml",
        "grafana/provisioning/datasources/prometheus.yml",
        "grafana/provisioning/dashboards/jaxinfer.yml",
    ],
)
def test_the_configuration_files_parse(path):
    assert yaml.safe_load((MONITORING / path).read_text())


def test_compose_mounts_what_exists_and_prometheus_scrapes_a_metrics_port():
    compose = yaml.safe_load((MONITORING / "docker-compose.yml").read_text())
    for service in compose["services"].values():
        for volume in service["volumes"]:
            assert (MONITORING / volume.split(":")[0]).exists(), volume
    scrape = yaml.safe_load((MONITORING / "prometheus.yml").read_text())["scrape_configs"]
    targets = [t for job in scrape for sc in job["static_configs"] for t in sc["targets"]]
    assert targets and all(re.fullmatch(r"[\w.-]+:\d+", t) for t in targets)
