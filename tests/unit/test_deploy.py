"""The deployment files parse and fit what the configs they run ask for:
cluster.yaml (Ray cluster launcher), deploy/rayservice.yaml and deploy/rayjob.yaml (KubeRay)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import yaml
from ray.serve.schema import ServeDeploySchema

from rlgate.config import load_config
from rlgate.training.placement import plan, unplaceable
from tests.support import ROOT


def pod_resources(group: dict) -> dict[str, float]:
    """What Ray sees on a KubeRay pod: its container's CPU and GPU limits, and the
    custom resources of its rayStartParams (KubeRay's quoted JSON string)."""
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    custom = group["rayStartParams"].get("resources")
    return {
        "CPU": float(limits["cpu"]),
        "GPU": float(group["rayStartParams"].get("num-gpus", limits.get("nvidia.com/gpu", 0))),
        **(json.loads(json.loads(custom)) if custom else {}),
    }


def kuberay_nodes(cluster: dict) -> list[dict[str, float]]:
    workers = [pod_resources(group) for group in cluster["workerGroupSpecs"] for _ in range(group["maxReplicas"])]
    return [pod_resources(cluster["headGroupSpec"]), *workers]


def test_cluster_yaml_node_types_hold_the_cluster_config():
    cluster = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    types = cluster["available_node_types"]
    assert cluster["head_node_type"] in types and types[cluster["head_node_type"]]["resources"].get("GPU", 0) == 0
    assert sum(t["max_workers"] for t in types.values()) <= cluster["max_workers"] + types["head"]["max_workers"]
    assert any("rlgate[gpu]" in command for command in cluster["setup_commands"])
    # at full scale the node types hold configs/cluster.toml's rollout replicas and trainer workers
    nodes = [dict(t["resources"]) for t in types.values() for _ in range(max(1, t["max_workers"]))]
    config = load_config(ROOT / "configs" / "cluster.toml")
    assert unplaceable(plan(config, config.compute.gpus_per_worker), nodes) is None
    assert config.gateway.host == "0.0.0.0"  # the head serves agents on other machines


def test_rayservice_runs_the_serve_application():
    service = yaml.safe_load((ROOT / "deploy" / "rayservice.yaml").read_text())
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    serve = ServeDeploySchema.model_validate(yaml.safe_load(service["spec"]["serveConfigV2"]))
    [application] = serve.applications
    assert application.import_path == "serve_app:app"
    load_config(ROOT / application.args["config"])
    deployments = {d.name: d for d in application.deployments}
    assert set(deployments) == {"Gateway", "RolloutServer"}
    rollout = deployments["RolloutServer"]
    nodes = kuberay_nodes(service["spec"]["rayClusterConfig"])
    gpus = rollout.ray_actor_options.num_gpus
    assert sum(1 for n in nodes if n["GPU"] >= gpus) >= rollout.autoscaling_config["max_replicas"]
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {"name": "RLGATE_ADMIN_KEY", "valueFrom": {"secretKeyRef": {"name": "rlgate", "key": "admin-key"}}} in head[
        "env"
    ]


def test_rayjob_runs_the_driver_on_a_cluster_that_holds_it():
    job = yaml.safe_load((ROOT / "deploy" / "rayjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    command = shlex.split(job["spec"]["entrypoint"])
    assert command[:2] == ["python", "train_driver.py"]
    config = load_config(ROOT / command[command.index("--config") + 1])
    assert Path(command[command.index("--run-dir") + 1]).is_absolute()  # outlives the job's working copy
    nodes = kuberay_nodes(job["spec"]["rayClusterSpec"])
    assert unplaceable(plan(config, config.compute.gpus_per_worker), nodes) is None


def test_grafana_dashboard_charts_every_metric():

    from rlgate.telemetry import METRICS

    dashboard = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    queries = " ".join(t["expr"] for panel in dashboard["panels"] for t in panel["targets"])
    uncharted = [name for name in METRICS if f"ray_{name.removesuffix('_total')}" not in queries]
    assert not uncharted, f"metrics with no panel: {uncharted}"
    assert all('run=~"$run"' in t["expr"] for panel in dashboard["panels"] for t in panel["targets"])
