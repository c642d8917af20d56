"""RL jobs over real HTTP: the gateway's /api/rl/jobs on the test cluster's Serve
proxy, each job a real Ray job running train_driver.py against a real task app
(examples/math_task_app.py) on tiny-random, driven through the SDK."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx
import pytest
import ray

from rlgate.sdk.client import RLGateError, RLJob
from tests.support import free_port, generated_keys, serve_asgi, start_gateway, synth_ai_env, synth_ai_python

pytestmark = pytest.mark.long  # minutes: `make test` hands this module out first

TASK_APP_KEY = "env-key-for-the-jobs-tests"


@pytest.fixture(scope="module")
def jobsgw(ray_session, tmp_path_factory):
    from ray import serve

    port = int(ray_session.serve_url.rsplit(":", 1)[1])
    settings = {
        "model": {"name": "tiny-random"},
        # its own engine only answers the CLI's session calls; each job starts its own
        "rollout": {"engine": "hf", "max_model_len": 512},
        "gateway": {"port": port, "max_running_jobs": 1},
        "jobs": {
            "task_app_hosts": ["127.0.0.1"],  # the tests' task apps run on loopback
            # the HF engine, for jobs that do not name one: these tests are of the job's path (its driver's
            # vLLM runs are test_training's); vLLM's start costs a job about 25 CPU-seconds more
            "engine": "hf",
            "models": {"Qwen/Qwen3-0.6B": "tiny-random"},  # what synth-ai's SDK may name, as this cluster has it
        },
    }
    app = start_gateway(ray_session, tmp_path_factory, "jobsgw", settings)
    yield app
    serve.delete("jobsgw")


SEEN: list = []  # every RolloutRequest the task app got


@pytest.fixture(scope="module")
def task_app():
    """examples/math_task_app.py, except that every sixth rollout crashes."""
    from examples.math_task_app import rollout
    from rlgate.sdk.taskapp import create_task_app

    calls = [0]

    async def flaky(episode):
        SEEN.append(episode.request)
        calls[0] += 1
        if calls[0] % 6 == 0:
            raise RuntimeError("the simulator fell over")
        return await rollout(episode)

    with serve_asgi(create_task_app("math", flaky, api_key=TASK_APP_KEY)) as url:
        yield url


def payload(task_url: str, steps: int = 2, **training) -> dict:
    """synth-ai's payload shape, with an RL config in synth-ai's TOML shape."""
    config = {
        "algorithm": {"type": "online", "method": "policy_gradient", "variety": "grpo"},
        "model": {"base": "smollm2-135m-instruct", "trainer_mode": "full"},
        "rollout": {"env_name": "math", "max_concurrent_rollouts": 8, "max_turns": 1},
        # batch_size counts groups, as synth-ai does: 2 groups of 4 episodes a step
        "training": {"batch_size": 2, "group_size": 4, "learning_rate": 1e-3, "iterations_per_epoch": steps} | training,
        "vllm": {"max_model_len": 512},
        "evaluation": {"every_n_iters": 2, "seeds": [900, 901, 902], "instances": 3},
    }
    return {
        "job_type": "rl",
        "compute": {"gpu_type": "cpu", "gpu_count": 0},
        "data": {"endpoint_base_url": task_url, "config": config, "model": "tiny-random"},
        "tags": {"test": "jobs"},
        "task_app_api_key": TASK_APP_KEY,
    }


def wait_for(job: RLJob, statuses: set[str], timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while (status := job.get_status())["status"] not in statuses:
        assert time.monotonic() < deadline, f"job stayed {status['status']}: {status}"
        time.sleep(0.5)
    return status


def test_a_job_runs_on_ray_and_reports_results_events_and_metrics(jobsgw, task_app, tmp_path):
    job = RLJob(jobsgw.url, jobsgw.admin_key, payload(task_app), idempotency_key="first-job")
    job_id = job.submit()
    twin = RLJob(jobsgw.url, jobsgw.admin_key, payload(task_app), idempotency_key="first-job")
    assert twin.submit() == job_id and twin.job_api_key is None  # the same job; its key is shown once only
    seen = []
    final = job.poll_until_complete(timeout=600, interval=0.5, on_status=lambda s: seen.append(s["status"]))
    assert final["status"] == "succeeded", (final["error"], final["progress"])
    assert set(seen) <= {"queued", "running", "succeeded"} and seen[-1] == "succeeded"
    assert final["started_at"] <= final["finished_at"] and final["progress"]["step"] == 2
    assert final["progress"]["failed_episodes"] > 0  # crashed rollouts cost only themselves

    results = job.get_results()
    assert isinstance(results["final_reward"], float)
    assert [c["step"] for c in results["checkpoints"]] == [2] and results["model_path"] == results["checkpoints"][0][
        "path"
    ]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(results["model_path"]).num_parameters() > 0

    events = job.events()
    assert [e["type"] for e in events] == [
        "rl.created",
        "rl.running",
        "rl.iteration.complete",
        "rl.iteration.complete",
        "rl.evaluation.complete",  # every 2 steps, on the 3 held-out seeds
        "rl.succeeded",
    ]
    evaluated = events[4]["data"]
    assert evaluated["step"] == 2 and evaluated["eval_episodes"] + evaluated["eval_failed"] == 3
    assert [e["seq"] for e in job.events(since_seq=4)] == [5, 6]
    assert [m["step"] for m in job.metrics(after_step=1)] == [2]
    assert [m["step"] for m in job.metrics(after_step=-1)] == [1, 2]  # synth-ai's SDK asks with -1 for all

    # It was a Ray job: Ray's own job API (the dashboard's) knows it by the same id.
    from ray.job_submission import JobStatus, JobSubmissionClient

    assert JobSubmissionClient(ray.get_runtime_context().gcs_address).get_job_info(job_id).status == JobStatus.SUCCEEDED

    # The job's own key reaches this job only; the admin key reaches all.
    own = RLJob.from_job_id(job_id, jobsgw.url, job.job_api_key)
    assert own.get_status()["status"] == "succeeded"
    listing = httpx.get(f"{jobsgw.url}/api/rl/jobs", headers={"Authorization": f"Bearer {job.job_api_key}"})
    assert listing.status_code == 401
    assert job_id in [j["job_id"] for j in httpx.get(f"{jobsgw.url}/api/rl/jobs", headers=jobsgw.admin).json()]

    # Training never saw a failed episode; the task app saw the contract: RL then eval mode, our seeds,
    # a session-scoped inference URL under the job's own gateway for every episode.
    run = jobsgw.run_dir.parent / "jobs" / job_id / "runs" / job_id
    saved = {r["seq"]: r for f in sorted((run / "trajectories").glob("*.jsonl")) for r in map(json.loads, f.open())}
    trained = [saved[seq] for b in map(json.loads, (run / "batches.jsonl").open()) for seq in b["seqs"]]
    assert trained and not any(r.get("failed") for r in trained) and any(r.get("failed") for r in saved.values())
    mine = [r for r in SEEN if f"/jobs/{job_id}/s/rlg-" in r.policy.config["inference_url"]]
    urls = [r.policy.config["inference_url"] for r in mine]
    assert len(set(urls)) == len(urls) and all(u.endswith("/v1") for u in urls)
    assert {r.env.seed for r in mine if r.mode == "eval"} == {900, 901, 902}
    assert {r.env.seed for r in mine if r.mode == "rl"} <= set(range(100))  # no [task] seeds: 0, 1, 2, ...
    assert all(r.env.config["max_turns"] == 1 and r.env.env_name == "math" for r in mine)

    # The CLI: the same idempotency key finds the finished job; --poll reports how it ended.
    toml = tmp_path / "same.toml"
    toml.write_text('[model]\nname = "tiny-random"\n[task]\nenv_name = "math"\n')
    polled = rlgate(
        jobsgw, "train", "--config", str(toml), "--task-app", task_app, "--idempotency-key", "first-job", "--poll"
    )
    assert polled.returncode == 0, polled.stderr
    assert f"rlgate: job {job_id} submitted" in polled.stdout and f"rlgate: job {job_id} succeeded" in polled.stdout
    shown = json.loads(rlgate(jobsgw, "jobs", "status", job_id).stdout)
    assert shown["results"] == results

    # No key is in any of the job's files (records, events, config, run folder) or its logs: not the ones
    # this test holds (admin, job, the task app's), nor any key rlgate made for the job (its gateway's
    # admin key, its episodes' session keys), which are found by their shape. No secret file either.
    folder = jobsgw.run_dir.parent / "jobs" / job_id
    secrets = [jobsgw.admin_key, job.job_api_key, TASK_APP_KEY]
    logs = JobSubmissionClient(ray.get_runtime_context().gcs_address).get_job_logs(job_id)
    texts = {str(p): p.read_bytes() for p in folder.rglob("*") if p.is_file()} | {"the job's logs": logs.encode()}
    leaks = [where for where, data in texts.items() if generated_keys(data) or any(k.encode() in data for k in secrets)]
    assert not leaks, leaks
    assert "rlg-" not in logs.replace("rlg-admin", "")  # not even part of a session key
    assert not (folder / "admin_key").exists() and not (folder / "task_app_key").exists()
    assert urls and all(generated_keys(url) for url in urls)  # the job's session keys have the shape looked for

    # Job state lives on disk: a restarted JobManager answers as before.
    ray.kill(ray.get_actor("rlgate-jobsgw-jobs", namespace="rlgate"))
    time.sleep(1)
    assert job.get_status() == final and len(job.events()) == 6


def test_bad_requests_are_refused_with_what_was_wrong(jobsgw, task_app):
    post = lambda body, **kw: httpx.post(f"{jobsgw.url}/api/rl/jobs", json=body, **kw)  # noqa: E731
    assert post(payload(task_app)).status_code == 401
    bad = payload(task_app)
    bad["data"]["config"]["model"]["trainer_mode"] = "qlora"  # not honoured here, and it would change the results
    answer = post(bad, headers=jobsgw.admin)
    assert answer.status_code == 422 and "model.trainer_mode: full fine-tuning ('full') or 'lora'" in answer.text
    assert "wrong type" not in answer.text  # said once, not wrapped
    typo = payload(task_app) | {"dat": {}}
    answer = post(typo, headers=jobsgw.admin)
    assert answer.status_code == 422 and "dat" in answer.text
    metadata = post(payload("http://169.254.169.254/latest/meta-data"), headers=jobsgw.admin)  # not allowed
    assert metadata.status_code == 422 and "169.254.169.254, a link-local address" in metadata.text
    assert "[jobs] task_app_hosts" in metadata.text
    huge = payload(task_app) | {"compute": {"gpu_type": "H100", "gpu_count": 8}}
    answer = post(huge, headers=jobsgw.admin)
    assert (
        answer.status_code == 422 and "the cluster can never run this: it needs" in answer.text and "GPU" in answer.text
    )
    with pytest.raises(RLGateError) as missing:
        RLJob.from_job_id("job-nope", jobsgw.url, jobsgw.admin_key).get_status()
    assert missing.value.status == 404


def test_a_task_app_that_refuses_our_key_fails_the_job_with_the_reason(jobsgw, task_app):
    job = RLJob(jobsgw.url, jobsgw.admin_key, payload(task_app) | {"task_app_api_key": "not-the-key"})
    job.submit()
    final = job.poll_until_complete(timeout=300, interval=0.5)
    assert final["status"] == "failed" and "/health: 401 unauthorised" in final["error"]


def test_an_unhealthy_task_app_fails_the_job_with_the_reason(jobsgw):
    job = RLJob(jobsgw.url, jobsgw.admin_key, payload(f"http://127.0.0.1:{free_port()}"))  # nothing listens
    job.submit()
    final = job.poll_until_complete(timeout=300, interval=0.5)
    assert final["status"] == "failed"
    assert "task app check failed: GET" in final["error"] and "/health: unreachable" in final["error"]
    assert job.events()[-1]["type"] == "rl.failed"


def rlgate(gw, *args: str) -> subprocess.CompletedProcess:
    """The ``rlgate`` command against the test gateway."""
    command = [sys.executable, "-m", "rlgate.cli", *args, "--backend", gw.url, "--api-key", gw.admin_key]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_the_cli_submits_lists_and_explains_errors(jobsgw, task_app, tmp_path):
    config = tmp_path / "job.toml"
    config.write_text(
        '[model]\nname = "tiny-random"\n[rollout]\nmax_model_len = 512\n[training]\nbatch_size = 6\ngroup_size = 4\n'
    )
    bad = rlgate(jobsgw, "train", "--config", str(config), "--task-app", task_app)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.splitlines()[0].startswith("rlgate: error: 422: invalid job config")
    assert "batch_size (6) must be a multiple of group_size (4)" in bad.stderr and "rlgate: hint:" in bad.stderr
    missing = rlgate(jobsgw, "jobs", "status", "job-nope")
    assert missing.returncode == 2 and missing.stderr.splitlines() == [
        "rlgate: error: 404: no job 'job-nope'",
        "rlgate: hint: `rlgate jobs list` shows the jobs there are",
    ]
    started = rlgate(jobsgw, "session", "start", "--task-id", "cli")
    session = json.loads(started.stdout)
    assert session["inference_url"].endswith("/v1") and session["api_key"].startswith("rlg-")
    ended = rlgate(jobsgw, "session", "end", "--key", session["api_key"], "--failed")
    assert ended.returncode == 0 and json.loads(ended.stdout)["interaction_count"] == 0
    again = rlgate(jobsgw, "session", "reward", "--key", session["api_key"], "1.0")
    assert again.returncode == 2 and "410: this session has ended" in again.stderr


def test_jobs_queue_beyond_capacity_and_cancel_mid_run(jobsgw, task_app, tmp_path):
    first = RLJob(jobsgw.url, jobsgw.admin_key, payload(task_app, steps=200))
    first.submit()
    config = tmp_path / "long.toml"  # the second through the CLI, in rlgate's own TOML shape
    config.write_text(
        '[model]\nname = "tiny-random"\n[rollout]\nmax_model_len = 512\nkv_cache_gib = 0.5\n'
        '[training]\nbatch_size = 8\ngroup_size = 4\ntotal_steps = 200\n[task]\nenv_name = "math"\n'
    )
    submitted = rlgate(jobsgw, "train", "--config", str(config), "--task-app", task_app, "--task-app-key", TASK_APP_KEY)
    assert submitted.returncode == 0, submitted.stderr
    second_id, second_key = re.match(r"rlgate: job (\S+) submitted; its own key: (\S+)", submitted.stdout).groups()
    second = RLJob.from_job_id(second_id, jobsgw.url, jobsgw.admin_key)
    wait_for(first, {"running"})
    queued = second.get_status()
    assert queued["status"] == "queued" and "as many as [gateway] max_running_jobs allows" in queued["waiting"]
    listed = rlgate(jobsgw, "jobs", "list").stdout
    assert re.search(rf"{first.job_id}\s+running", listed) and re.search(rf"{second_id}\s+queued", listed)
    for touch in ("get_status", "events", "metrics", "get_results", "cancel"):  # one job's key neither reads
        with pytest.raises(RLGateError) as foreign:  # nor cancels another job
            getattr(RLJob.from_job_id(second.job_id, jobsgw.url, first.job_api_key), touch)()
        assert foreign.value.status == 403, touch
    assert first.cancel()["status"] == "cancelled"
    wait_for(second, {"running"})  # the queue moves on
    assert RLJob.from_job_id(second_id, jobsgw.url, second_key).cancel()["status"] == "cancelled"
    for job in (first, second):
        assert job.events()[-1]["type"] == "rl.cancelled"
        with pytest.raises(RLGateError) as again:
            job.cancel()
        assert again.value.status == 409
    events = rlgate(jobsgw, "jobs", "events", second_id).stdout.splitlines()
    assert (events[0].split()[1], events[-1].split()[1]) == ("rl.created", "rl.cancelled")
    # both drivers stop and take their Serve apps with them
    from ray import serve

    deadline = time.monotonic() + 180
    while any(name.startswith("rlgate-job-") for name in serve.status().applications):
        assert time.monotonic() < deadline, serve.status().applications.keys()
        time.sleep(1)


SDK_CONFIG = """
type = "rl"
[algorithm]
type = "online"
method = "policy_gradient"
variety = "gspo"
[model]
base = "Qwen/Qwen3-0.6B"  # the SDK allows only the models it knows; the gateway's [jobs] models maps it
trainer_mode = "full"
label = "sdk-math"
[compute]
gpu_type = "cpu"
gpu_count = 1
[topology]
type = "single_node_split"
gpus_for_vllm = 1
gpus_for_training = 1
[rollout]
env_name = "math"
policy_name = "math"
max_turns = 1
episodes_per_batch = 8
max_concurrent_rollouts = 8
[training]
num_epochs = 1
iterations_per_epoch = 2
max_turns = 1
batch_size = 2  # groups, as synth-ai counts: 2 x 4 = 8 episodes per step
group_size = 4
learning_rate = 1e-3
log_interval = 1
[vllm]
max_model_len = 512
[reference]
placement = "none"
[tags]
experiment = "sdk"
"""

SDK_DRIVER = """
import json, sys
from synth_ai.sdk.api.train.rl import RLJob

config, backend, key, task_app = sys.argv[1:5]
made = lambda: RLJob.from_config(config, backend_url=backend, api_key=key, task_app_url=task_app,
                                 idempotency_key="sdk-run-1")
job = made()
job_id = job.submit()
again = made().submit()  # the same idempotency key: the same job
final = job.poll_until_complete(timeout=900, interval=1)
try:
    results = job.get_results()
except AssertionError as err:  # 0.4.4 fails here before it sends anything (see the test)
    results = f"AssertionError: {err}"
print(json.dumps({"job_id": job_id, "again": again, "final": final, "results": results}))
"""


def test_synth_ais_own_sdk_runs_a_job_that_waits_for_the_busy_cluster_then_finishes(jobsgw, tmp_path):
    """synth-ai 0.4.4's unmodified SDK (a venv of its own): RLJob.from_config ->
    submit -> poll_until_complete against /api/rl/jobs, and a resubmission with the
    same idempotency key, then get_results. (Its get_status and get_results fail
    on the client in 0.4.4: they use an async HTTP client outside its context;
    poll_until_complete returns the same status, results included.)

    Meanwhile every free CPU is taken by other actors: the job runs its driver,
    which waits, saying what it needs and who holds it (status and events). Then
    one CPU frees, as a two-CPU machine has beside configs/serve.toml's engine:
    the job starts in it and runs to completion ([jobs] cpus_per_bundle: 0.5 CPU
    for its rollout replica, 0.5 for its trainer worker)."""
    from examples.math_task_app import rollout
    from rlgate.sdk.taskapp import create_task_app

    @ray.remote
    class Hog:
        def ready(self) -> bool:
            return True

    def said() -> str:
        return (tmp_path / "sdk.out").read_text()[-2000:] + (tmp_path / "sdk.err").read_text()[-3000:]

    python = synth_ai_python()
    (tmp_path / "rl.toml").write_text(SDK_CONFIG)
    (tmp_path / "drive.py").write_text(SDK_DRIVER)
    free = ray.available_resources().get("CPU", 0.0)
    assert free >= 1.0, f"the test needs a free CPU to give the job, {free} free"
    rest = Hog.options(num_cpus=free - 1.0, name="cpu-hog-that-stays", namespace="rlgate").remote()
    hog = Hog.options(num_cpus=1.0, name="cpu-hog-of-the-test", namespace="rlgate").remote()
    ray.get([rest.ready.remote(), hog.ready.remote()])
    sdk = None
    try:
        with serve_asgi(create_task_app("math", rollout)) as task_url:  # no key: the SDK never gives rlgate one
            command = [str(python), "drive.py", "rl.toml", jobsgw.url, jobsgw.admin_key, task_url]
            with open(tmp_path / "sdk.out", "w") as out, open(tmp_path / "sdk.err", "w") as err:  # no pipe to fill
                sdk = subprocess.Popen(command, stdout=out, stderr=err, cwd=tmp_path, env=synth_ai_env(tmp_path))
            deadline = time.monotonic() + 300
            while True:
                assert sdk.poll() is None, f"the SDK ended before the job said why it waits: {said()}"
                assert time.monotonic() < deadline, "the job never said why it waits"
                listed = httpx.get(f"{jobsgw.url}/api/rl/jobs", headers=jobsgw.admin).json()
                mine = [j for j in listed if j["tags"].get("experiment") == "sdk"]
                if mine and mine[0]["waiting"] is not None:
                    break
                time.sleep(0.5)
            [status] = mine
            assert status["status"] == "running"
            assert "needs 0.5 CPU" in status["waiting"] and "cpu-hog-of-the-test" in status["waiting"], status
            ray.kill(hog)  # one CPU free, no more
            sdk.wait(timeout=1200)
    finally:
        if sdk is not None and sdk.poll() is None:
            sdk.kill()
        ray.kill(hog)
        ray.kill(rest)
    assert sdk.returncode == 0, said()
    answer = json.loads((tmp_path / "sdk.out").read_text().strip().splitlines()[-1])
    assert answer["job_id"] == status["job_id"] and answer["again"] == answer["job_id"]
    final = answer["final"]
    assert final["status"] == "succeeded", (final["error"], final["progress"])
    # get_results is the SDK's get_status, whose JobsClient is used outside `async with`: an assert in
    # synth-ai's own HTTP client, on the client, before any request (the poll above carries the results)
    assert answer["results"] in (final["results"], "AssertionError: Must use as async context manager")
    assert final["progress"]["step"] == 2 and [c["step"] for c in final["results"]["checkpoints"]] == [2]
    assert final["model"] == "tiny-random" and final["results"]["final_reward"] is not None
    assert final["tags"]["experiment"] == "sdk"  # the config's [tags], kept on the job
    events = RLJob.from_job_id(answer["job_id"], jobsgw.url, jobsgw.admin_key).events()
    [ignored] = [e for e in events if e["type"] == "rl.config.ignored"]
    assert "training.log_interval" in ignored["message"] and "topology.type" in ignored["message"]
    kinds = [e["type"] for e in events]
    assert kinds.index("rl.waiting") < kinds.index("rl.resources")
