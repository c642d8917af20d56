"""rlgate on a Ray cluster of several processes, the way users run it there:
`ray start --head` and a second `ray start --address` node on loopback, each
with its own resources; `ray job submit --working-dir .` of train_driver.py
with split placement; sessions through the gateway with the official openai
client; GRPO steps; where Ray put the replica and the trainer worker, from
Ray's state API; the driver's step gauges from Ray's metrics endpoint; then
`serve run` of configs/serve.yaml on the same cluster."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from rlgate.config import load_config
from rlgate.training.placement import ROLLOUT_RESOURCE, TRAINER_RESOURCE
from tests.support import BIN, ROOT, RayNodes, free_port, lines

ADMIN_KEY = "cluster-test-admin-key-0123456789"

pytestmark = pytest.mark.long  # minutes: `make test` hands this module out first


class Cluster(RayNodes):
    """The two nodes, with the calls the tests make of them."""

    def cli(self, *args: str, timeout: float = 300) -> str:
        done = subprocess.run(
            [str(BIN / args[0]), *args[1:]], env=self.env, capture_output=True, text=True, timeout=timeout, cwd=ROOT
        )
        assert done.returncode == 0, f"{' '.join(args[:3])}: {done.stdout[-2000:]}{done.stderr[-3000:]}"
        return done.stdout

    def job(self, job_id: str) -> dict:
        return httpx.get(f"{self.dashboard}/api/jobs/{job_id}", timeout=30).json()

    def job_logs(self, job_id: str) -> str:
        return httpx.get(f"{self.dashboard}/api/jobs/{job_id}/logs", timeout=30).json()["logs"]

    def metrics(self) -> str:
        return "\n".join(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text for port in self.metrics_ports)


def wait_for(what: str, check, timeout_s: float, every_s: float = 1.0, context=lambda: ""):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if result := check():
                return result
        except httpx.HTTPError:
            pass
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}\n{context()}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head node offering rlgate_rollout and a worker node offering
    rlgate_trainer, two CPUs each, every port and the temp dir their own (the
    test session's Ray runs beside them)."""
    nodes = Cluster.head(tmp_path_factory.mktemp("cluster"), 2, {ROLLOUT_RESOURCE: 1}, nodes=2)
    try:
        nodes.worker("worker", 2, {TRAINER_RESOURCE: 1})
        wait_for("two nodes", lambda: sum(n["state"] == "ALIVE" for n in nodes.state("nodes")) == 2, 120)
        yield nodes
    finally:  # every process below the nodes is gone before the next module starts
        nodes.stop()


def episode(url: str, task: str, reward: float) -> None:
    """One session, as an agent runs it: a key from the admin, a chat completion
    with the official client, a reward, the end."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    started = httpx.post(f"{url}/rl/start_session", json={"task_id": task, "wait_s": 60}, headers=admin, timeout=90)
    assert started.status_code == 200, started.text
    key = started.json()["api_key"]
    with openai.OpenAI(base_url=f"{url}/v1", api_key=key) as client:
        reply = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": f"Say {task}."}], max_tokens=6
        )
    assert reply.choices[0].message.content is not None
    session = {"Authorization": f"Bearer {key}"}  # (httpx's default 5 s ran out once while the trainer started)
    assert httpx.post(f"{url}/rl/set_reward", json={"reward": reward}, headers=session, timeout=60).status_code == 200
    assert httpx.post(f"{url}/rl/end_session", headers=session, timeout=60).status_code == 200


def one_batch(url: str, step: int) -> None:
    """Two groups of two sessions with different rewards: one training batch."""
    for group in range(2):
        for reward in (0.0, 1.0):
            episode(url, f"step{step}-group{group}", reward)


def test_ray_job_submit_on_two_nodes_serves_trains_and_places_by_compute(cluster, tmp_path):
    port, runs, job_id = free_port(), tmp_path / "runs", "rlgate-two-nodes"
    key_file = tmp_path / "admin_key"
    key_file.write_text(ADMIN_KEY)
    key_file.chmod(0o600)
    config = tmp_path / "two-nodes.toml"
    config.write_text(f"""
[model]
name = "tiny-random"
[rollout]
engine = "hf"
max_model_len = 512
[gateway]
run_name = "two-nodes"
port = {port}
[training]
batch_size = 4
group_size = 2
learning_rate = 3e-3
total_steps = 2
[compute]
gpus_per_worker = 0
placement = "split"
""")
    cluster.cli(
        "ray",
        "job",
        "submit",
        f"--address={cluster.dashboard}",
        f"--working-dir={ROOT}",
        f"--submission-id={job_id}",
        f"--runtime-env-json={json.dumps({'env_vars': {'RLGATE_ADMIN_KEY_FILE': str(key_file)}})}",
        "--no-wait",
        "--",
        "python",
        "train_driver.py",
        "--config",
        str(config),
        "--run-dir",
        str(runs),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        check_two_node_run(cluster, job_id, url, runs)
    finally:
        if cluster.job(job_id)["status"] in ("PENDING", "RUNNING"):  # a failed check: stop the run cleanly
            cluster.cli("ray", "job", "stop", f"--address={cluster.dashboard}", job_id)
            # A driver killed before its own cleanup leaves Serve, and its proxy's port, to the next test.
            cluster.cli("serve", "shutdown", f"--address={cluster.dashboard}", "--yes")


def check_two_node_run(cluster: Cluster, job_id: str, url: str, runs: Path) -> None:
    def logs() -> str:
        return cluster.job_logs(job_id)[-4000:]

    def serving() -> bool:
        status = cluster.job(job_id)["status"]
        assert status in ("PENDING", "RUNNING"), logs()
        return httpx.get(f"{url}/health", timeout=5).status_code == 200

    wait_for("the job's gateway", serving, 300, context=logs)
    one_batch(url, 1)  # at once: sessions that end before the trainer is up are trained on too
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}

    def version_1() -> bool:
        return httpx.get(f"{url}/rl/status", headers=admin).json()["policy_version"] == 1

    wait_for("policy version 1", version_1, 180, context=logs)

    # [compute] placement = "split": the replica on the rollout node, the trainer worker on the trainer node
    nodes = {n["node_id"]: n["resources_total"] for n in cluster.state("nodes") if n["state"] == "ALIVE"}
    alive = [a for a in cluster.state("actors") if a["state"] == "ALIVE"]
    replicas = [a for a in alive if a["class_name"].endswith("RolloutServer")]
    workers = [a for a in alive if "RayTrainWorker" in a["class_name"]]
    assert len(replicas) == 1 and len(workers) == 1, sorted(a["class_name"] for a in alive)
    assert ROLLOUT_RESOURCE in nodes[replicas[0]["node_id"]] and TRAINER_RESOURCE not in nodes[replicas[0]["node_id"]]
    assert TRAINER_RESOURCE in nodes[workers[0]["node_id"]] and ROLLOUT_RESOURCE not in nodes[workers[0]["node_id"]]

    # the driver's step gauges, tagged with the run, on Ray's metrics endpoint
    def exported() -> list[str]:
        text = cluster.metrics()
        found = [line for line in text.splitlines() if line.startswith("ray_rlgate_train_version{")]
        return [line for line in found if 'run="two-nodes"' in line and line.endswith(" 1.0")]

    wait_for("ray_rlgate_train_version = 1", exported, 90)
    text = cluster.metrics()
    for gauge in ("reward_mean", "step_s", "sync_s", "staleness", "collect_s"):
        assert f"ray_rlgate_train_{gauge}{{" in text, gauge

    one_batch(url, 2)
    finished = wait_for(
        "the job to end", lambda: cluster.job(job_id)["status"] in ("SUCCEEDED", "FAILED"), 300, context=logs
    )
    assert finished and cluster.job(job_id)["status"] == "SUCCEEDED", logs()
    output = cluster.job_logs(job_id)
    assert "rlgate: 2 steps, policy version 2" in output
    assert ADMIN_KEY not in output  # the key came in a file
    metrics = lines(runs / "two-nodes" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2] and all(m["samples"] == 4 for m in metrics)
    assert list((runs / "two-nodes" / "trainer").glob("step-*/model/config.json"))


def test_serve_run_of_the_serve_yaml_applies_its_replicas_resources_and_autoscaling(cluster, tmp_path, tiny_path):
    """configs/serve.yaml as shipped, but on a free port and serving tiny-random."""
    spec = yaml.safe_load((ROOT / "configs" / "serve.yaml").read_text())
    [shipped] = spec["applications"]
    settings = (ROOT / shipped["args"]["config"]).read_text().replace('"smollm2-135m-instruct"', '"tiny-random"')
    (tmp_path / "serve.toml").write_text(settings.replace('engine = "auto"', 'engine = "hf"'))
    port = free_port()
    spec["http_options"]["port"] = port
    shipped["args"]["config"] = str(tmp_path / "serve.toml")
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(spec))
    key_file = tmp_path / "admin_key"
    key_file.write_text(ADMIN_KEY)
    runtime_env = {"env_vars": {"RLGATE_ADMIN_KEY_FILE": str(key_file)}}
    cluster.cli(
        "serve",
        "run",
        str(tmp_path / "serve.yaml"),
        f"--address={cluster.gcs}",
        f"--working-dir={ROOT}",
        f"--runtime-env-json={json.dumps(runtime_env)}",
        "--non-blocking",
    )
    try:

        def running() -> dict | None:
            apps = httpx.get(f"{cluster.dashboard}/api/serve/applications/", timeout=30).json()["applications"]
            app = apps.get("rlgate", {})
            assert app.get("status") != "DEPLOY_FAILED", app
            return app if app.get("status") == "RUNNING" else None

        app = wait_for("the rlgate application", running, 300)
        wanted = {d["name"]: d for d in shipped["deployments"]}
        gateway, rollout = app["deployments"]["Gateway"], app["deployments"]["RolloutServer"]
        assert gateway["deployment_config"]["num_replicas"] == wanted["Gateway"]["num_replicas"]
        assert gateway["deployment_config"]["ray_actor_options"]["num_cpus"] == 0
        autoscaling = rollout["deployment_config"]["autoscaling_config"]
        for knob, value in wanted["RolloutServer"]["autoscaling_config"].items():
            assert autoscaling[knob] == value, knob
        assert rollout["deployment_config"]["ray_actor_options"]["num_cpus"] == 1
        replicas = [r for r in rollout["replicas"] if r["state"] == "RUNNING"]
        assert len(replicas) == autoscaling["min_replicas"]
        # and it serves: a session with the official client through the file's proxy
        episode(f"http://127.0.0.1:{port}", "served", 1.0)
    finally:
        cluster.cli("serve", "shutdown", f"--address={cluster.dashboard}", "--yes")


def test_an_admin_key_is_judged_where_serve_really_listens(cluster, tmp_path, tiny_path):
    """The TOML's [gateway] host says loopback, the Serve config binds 0.0.0.0:
    a weak key is refused (by the build task, which asks Serve's controller), and
    so is a key no one vouched for by the Gateway replica itself (a driver that
    deploys onto a Serve already listening beyond loopback)."""
    spec = yaml.safe_load((ROOT / "configs" / "serve.yaml").read_text())
    [shipped] = spec["applications"]
    settings = (ROOT / shipped["args"]["config"]).read_text().replace('"smollm2-135m-instruct"', '"tiny-random"')
    assert load_config(ROOT / shipped["args"]["config"]).gateway.host == "127.0.0.1"
    (tmp_path / "serve.toml").write_text(settings.replace('engine = "auto"', 'engine = "hf"'))
    spec["http_options"] = {"host": "0.0.0.0", "port": free_port()}
    shipped["args"]["config"] = str(tmp_path / "serve.toml")
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(spec))

    def application() -> dict:
        return httpx.get(f"{cluster.dashboard}/api/serve/applications/", timeout=30).json()["applications"]

    try:
        for name, env_vars in [("rlgate", {"RLGATE_ADMIN_KEY": "changeme"}), ("again", {"RLGATE_ADMIN_KEY": ""})]:
            shipped["name"] = name  # a new application each time, so the failure below is this deploy's
            (tmp_path / "serve.yaml").write_text(yaml.safe_dump(spec))
            runtime_env = json.dumps({"env_vars": env_vars})
            serve_run = ["serve", "run", str(tmp_path / "serve.yaml"), f"--address={cluster.gcs}"]
            cluster.cli(*serve_run, f"--working-dir={ROOT}", f"--runtime-env-json={runtime_env}", "--non-blocking")
            failed = wait_for(
                "the deploy to fail",
                lambda name=name: (app := application().get(name, {})).get("status") == "DEPLOY_FAILED" and app,
                300,
                context=lambda: json.dumps(application())[-3000:],
            )
            assert (
                "refusing to serve on 0.0.0.0 (beyond loopback) with a weak or generated admin key"
                in (failed["message"])
            )
            assert "changeme" not in failed["message"] and "rlg-admin-" not in failed["message"]
        # Serve now listens on 0.0.0.0; a driver deploys with a strong key it did not vouch for
        driver = f"""
import ray
from ray import serve
from rlgate.config import load_config
from rlgate.sessions.manager import hash_key
from rlgate.serving.app import build_app
ray.init(address="{cluster.gcs}", runtime_env={{"working_dir": "{ROOT}"}})
try:
    serve.run(build_app(load_config("{tmp_path / "serve.toml"}"), hash_key("{ADMIN_KEY}")), name="direct")
except Exception as error:
    print("FAILED", error)
"""
        done = subprocess.run(
            [sys.executable, "-c", driver], env=cluster.env, capture_output=True, text=True, timeout=600, cwd=ROOT
        )
        assert "FAILED" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]
        assert "refusing to serve on 0.0.0.0 (beyond loopback)" in done.stdout + done.stderr
    finally:
        cluster.cli("serve", "shutdown", f"--address={cluster.dashboard}", "--yes")
