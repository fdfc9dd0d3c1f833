"""The KubeRay examples (deploy/kuberay/, not run here: there is no Kubernetes) say what jaxinfer
takes: the RayJob's entrypoint parses as `jaxinfer batch --ray`, the RayService's Serve config
names an import path that resolves and whose args build the application, and both ask Ray for
the TPU chips their Kubernetes containers hold."""

import shlex
from pathlib import Path

import pytest
import yaml

from jaxinfer.cli import build_parser

KUBERAY = Path(__file__).resolve().parents[2] / "deploy" / "kuberay"


def load(name: str) -> dict:
    return yaml.safe_load((KUBERAY / name).read_text())


def tpu_groups(cluster: dict) -> list[dict]:
    return [g for g in cluster["workerGroupSpecs"] if "TPU" in g["rayStartParams"].get("resources", "")]


def test_the_rayjob_runs_a_batch_command_jaxinfer_parses():
    job = load("rayjob-batch-tpu.yaml")
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[0] == "jaxinfer"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "batch" and args.ray == "auto" and args.replicas == 2
    assert args.ray_resources == '{"TPU": 4}' and args.mesh == "tensor=4"
    (group,) = tpu_groups(job["spec"]["rayClusterSpec"])
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["google.com/tpu"] == "4" and group["replicas"] >= args.replicas  # one replica a slice


def test_the_rayservice_builds_the_serve_application():
    pytest.importorskip("ray.serve")
    service = load("rayservice-tpu.yaml")
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    (app,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    module, name = app["import_path"].split(":")
    builder = getattr(__import__(module, fromlist=[name]), name)
    built = builder(app["args"])
    assert type(built).__name__ == "Application"
    with pytest.raises(ValueError, match=r"app_builder: unknown arguments \['replicas'\]"):
        builder({**app["args"], "replicas": 2})
    with pytest.raises(ValueError, match="engine_kwargs: EngineConfig: unknown option 'max_seqs'"):
        builder({**app["args"], "engine_kwargs": {"max_seqs": 4}})
    (group,) = tpu_groups(service["spec"]["rayClusterConfig"])
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["google.com/tpu"] == "4" and app["args"]["ray_actor_options"]["resources"] == {"TPU": 4}
