"""The JobManager's own rules without Ray (a fake of Ray's job API, the cluster's
nodes given): which task apps a job may call (the operator's allowlist,
checked when the job is submitted), and where a job's secrets live (in the
JobManager's memory until the job's driver takes them: never in a file, an
environment variable or a record, and gone when the job ends however it ends)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import rlgate.actors.job_manager
from rlgate.actors.job_manager import JobManager
from rlgate.config import load_config
from rlgate.jobs import schema as jobs
from rlgate.sessions.manager import SessionError
from tests.support import generated_keys

TASK_APP_KEY = "task-app-key-of-the-unit-tests-0123456789"
TASK_APP = "http://127.0.0.1:8201"


class FakeRayJobs:
    """Ray's ``JobSubmissionClient``, as much as the JobManager uses."""

    def __init__(self) -> None:
        self.submitted: dict[str, dict] = {}
        self.status: dict[str, str] = {}

    def submit_job(self, entrypoint: str, submission_id: str, runtime_env: dict, metadata: dict) -> str:
        self.submitted[submission_id] = {"entrypoint": entrypoint, "runtime_env": runtime_env, "metadata": metadata}
        self.status[submission_id] = "PENDING"
        return submission_id

    def get_job_info(self, job_id: str):
        if job_id not in self.status:
            raise RuntimeError(f"Job {job_id} does not exist")  # what Ray's client raises
        value = self.status[job_id]
        terminal = value in ("SUCCEEDED", "FAILED", "STOPPED")
        return SimpleNamespace(status=SimpleNamespace(value=value, is_terminal=lambda: terminal), message="")

    def get_job_logs(self, job_id: str) -> str:
        return "rlgate: task app check failed: the driver's own reason\n"

    def stop_job(self, job_id: str) -> bool:
        self.status[job_id] = "STOPPED"
        return True


@pytest.fixture
def ray_jobs(monkeypatch) -> FakeRayJobs:
    monkeypatch.setattr(rlgate.actors.job_manager, "cluster_nodes", lambda bundles: [{"CPU": 64.0, "GPU": 0.0}])
    monkeypatch.setattr(JobManager, "_ensure_watcher", lambda self: None)  # the tests poll by hand

    async def no_leftovers(self, job_id: str) -> None:  # a finished job's Serve app and actors: Ray's business
        return None

    monkeypatch.setattr(JobManager, "_drop_leftovers", no_leftovers)
    return FakeRayJobs()


def manager(tmp_path, ray_jobs: FakeRayJobs, hosts=("127.0.0.1",), max_running: int = 1, **rules) -> JobManager:
    """A JobManager over ``tmp_path/jobs`` (a second one over the same folder is a restart)."""
    gateway = {"host": "127.0.0.1", "port": 8000}
    rules = {"task_app_hosts": list(hosts)} | rules
    return JobManager(str(tmp_path / "jobs"), gateway, max_running, rules, name="rlgate-t-jobs", client=ray_jobs)


def body(task_url: str = TASK_APP, key: str | None = TASK_APP_KEY, **config) -> dict:
    request = {"config": {"model": {"name": "tiny-random"}, **config}, "task_app_url": task_url}
    return request | ({"task_app_api_key": key} if key else {})


# --- no SSRF: the operator says which task apps jobs may call ---------------------------


@pytest.mark.parametrize(
    "url, named",
    [
        ("http://127.0.0.1:8265", "'127.0.0.1' resolves to 127.0.0.1, a loopback address"),  # Ray's dashboard
        ("http://[::1]:6379/", "'::1' resolves to ::1, a loopback address"),
        ("http://169.254.169.254/latest/meta-data", "'169.254.169.254' resolves to 169.254.169.254, a link-local"),
        ("http://10.0.0.8:8080", "'10.0.0.8' resolves to 10.0.0.8, a private address"),
        ("http://0.0.0.0:8000", "'0.0.0.0' resolves to 0.0.0.0, an unspecified address"),
    ],
)
async def test_a_task_app_at_a_non_public_address_is_refused_when_submitted(tmp_path, ray_jobs, url, named):
    jobs_manager = manager(tmp_path, ray_jobs, hosts=[])
    for request in (body(url), {"data": {"endpoint_base_url": url, "config": {"model": {"base": "tiny-random"}}}}):
        with pytest.raises(SessionError) as refused:
            await jobs_manager.submit(request, None)
        assert refused.value.status == 422
        assert named in refused.value.message and "[jobs] task_app_hosts" in refused.value.message
    assert not list((tmp_path / "jobs").iterdir()) and not ray_jobs.submitted  # nothing made, nothing run


@pytest.mark.parametrize(
    "url, message",
    [
        ("file:///etc/passwd", "must be http or https, not 'file'"),
        ("gopher://127.0.0.1:6379/_FLUSHALL", "must be http or https, not 'gopher'"),
        ("http://admin:pw@127.0.0.1:8201", "a user name or password"),
    ],
)
async def test_only_http_task_apps_without_credentials(tmp_path, ray_jobs, url, message):
    with pytest.raises(SessionError, match=message) as refused:
        await manager(tmp_path, ray_jobs).submit(body(url), None)
    assert refused.value.status == 422 and "pw" not in refused.value.message


async def test_the_operators_allowlist_rules_not_the_jobs_own(tmp_path, ray_jobs):
    """A job's config cannot widen what it may call: its [jobs] is replaced by the
    operator's, which is also what its driver checks every connection against."""
    jobs_manager = manager(tmp_path, ray_jobs, hosts=["127.0.0.1"])
    widened = {"jobs": {"task_app_hosts": ["0.0.0.0/0", "::/0"]}}
    with pytest.raises(SessionError, match="'10.0.0.8' resolves to 10.0.0.8, a private address"):
        await jobs_manager.submit(body("http://10.0.0.8:8201", **widened), None)
    created = await jobs_manager.submit(body(TASK_APP, **widened), None)
    saved = load_config(tmp_path / "jobs" / created["job_id"] / "config.toml")
    assert saved.jobs.task_app_hosts == ["127.0.0.1"] and saved.services.task_url == TASK_APP


# --- no secret at rest: keys live in memory until the driver takes them ---------------------


def test_the_leak_checks_recognise_every_kind_of_key_rlgate_makes():
    """tests.conftest.generated_keys is what every leak check greps with: it must know each key's shape."""
    from rlgate.sessions.manager import new_key, new_session_key

    made = [new_session_key(), new_session_key(3), new_key("rlg-job-"), new_key("rlg-admin-")]
    for key in made:
        assert generated_keys(f"GET /s/{key}/v1 and {key}.") == [key, key]
    assert generated_keys("rlgate-job-0a1b2c-jobs sess-0123456789abcdef01234567 rlg-short") == []


def files_holding_secrets(folder, secrets: list[str]) -> list[str]:
    found = []
    for path in folder.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            if generated_keys(data) or any(s.encode() in data for s in secrets):
                found.append(str(path.relative_to(folder)))
    return found


async def test_no_secret_is_written_to_the_job_folder_nor_handed_to_ray(tmp_path, ray_jobs):
    jobs_manager = manager(tmp_path, ray_jobs)
    created = await jobs_manager.submit(body(), "idem-1")
    job_id = created["job_id"]
    assert job_id in ray_jobs.submitted  # the first job starts at once
    assert files_holding_secrets(tmp_path / "jobs", [TASK_APP_KEY, created["api_key"]]) == []
    given = json.dumps(ray_jobs.submitted[job_id])  # entrypoint, env vars, metadata: all on Ray's dashboard
    assert TASK_APP_KEY not in given and generated_keys(given) == [] and "_FILE" not in given
    entrypoint = ray_jobs.submitted[job_id]["entrypoint"]
    assert (
        " -m rlgate.training.driver " in entrypoint and "--job-manager rlgate-t-jobs" in entrypoint
    )  # no checkout path
    # the job's driver takes the key once; after that the JobManager holds it no more
    assert await jobs_manager.take_task_app_key(job_id) == TASK_APP_KEY
    with pytest.raises(LookupError, match="submit the job again"):
        await jobs_manager.take_task_app_key(job_id)
    assert await jobs_manager.take_task_app_key((await jobs_manager.submit(body(key=None), None))["job_id"]) is None


@pytest.mark.parametrize("ending", ["SUCCEEDED", "FAILED", "STOPPED", "cancelled", "cancelled while queued", "lost"])
async def test_a_key_its_driver_never_took_is_dropped_however_the_job_ends(tmp_path, ray_jobs, ending):
    jobs_manager = manager(tmp_path, ray_jobs)
    first = (await jobs_manager.submit(body(), None))["job_id"]
    job_id = (await jobs_manager.submit(body(), None))["job_id"] if ending == "cancelled while queued" else first
    if ending.startswith("cancelled"):
        await jobs_manager.cancel(job_id, None)
    elif ending == "lost":  # Ray forgot the job (a cluster restart): half a minute of polls
        del ray_jobs.status[job_id]
        for _ in range(30):
            await jobs_manager._poll(jobs_manager.book.jobs[job_id])
    else:
        ray_jobs.status[job_id] = ending
        await jobs_manager._poll(jobs_manager.book.jobs[job_id])
    assert jobs_manager.book.jobs[job_id].status in jobs.FINISHED
    with pytest.raises(LookupError):
        await jobs_manager.take_task_app_key(job_id)


async def test_a_restarted_job_manager_fails_the_jobs_whose_key_it_lost(tmp_path, ray_jobs):
    before = manager(tmp_path, ray_jobs)
    running = (await before.submit(body(), None))["job_id"]
    queued = (await before.submit(body(), None))["job_id"]  # max_running 1: waits
    keyless = (await before.submit(body(key=None), None))["job_id"]
    after = manager(tmp_path, ray_jobs)  # a restart: the same folder, an empty memory
    assert after.book.jobs[queued].status == "failed" and "submit the job again" in after.book.jobs[queued].error
    assert after.book.jobs[keyless].status == "queued"
    with pytest.raises(LookupError, match="submit the job again"):  # its driver, starting now, is told why
        await after.take_task_app_key(running)
    assert await after.take_task_app_key(keyless) is None


async def test_a_restarted_job_manager_reports_each_evaluation_once(tmp_path, ray_jobs):
    before = manager(tmp_path, ray_jobs)
    job_id = (await before.submit(body(), None))["job_id"]
    run = before.book.run_dir(job_id)
    run.mkdir(parents=True, exist_ok=True)
    evaluation = {"step": 2, "eval_reward_mean": 0.5, "eval_episodes": 3, "eval_failed": 0, "seeds": []}
    (run / "eval.jsonl").write_text(json.dumps(evaluation) + "\n")
    before.book.catch_up(job_id)
    before.book.save(job_id)
    (run / "eval.jsonl").write_text(json.dumps(evaluation) + "\n" + json.dumps({**evaluation, "step": 4}) + "\n")
    after = manager(tmp_path, ray_jobs)  # a restart: what was reported is read back from the events
    after.book.catch_up(job_id)
    reported = [e.data["step"] for e in after.book.tracked[job_id].events if e.type == "rl.evaluation.complete"]
    assert reported == [2, 4]
    with pytest.raises(LookupError, match="submit the job again"):  # and the lost key is still said
        await after.take_task_app_key(job_id)


async def test_secret_files_an_earlier_version_left_are_removed(tmp_path, ray_jobs):
    before = manager(tmp_path, ray_jobs)
    done = (await before.submit(body(key=None), None))["job_id"]
    ray_jobs.status[done] = "SUCCEEDED"
    await before._poll(before.book.jobs[done])
    waiting = (await before.submit(body(key=None), None))["job_id"]
    for job_id in (done, waiting):  # what versions up to this one wrote beside each job's records
        (tmp_path / "jobs" / job_id / "admin_key").write_text("rlg-admin-" + "a" * 43)
        (tmp_path / "jobs" / job_id / "task_app_key").write_text(TASK_APP_KEY)
    after = manager(tmp_path, ray_jobs)
    assert files_holding_secrets(tmp_path / "jobs", [TASK_APP_KEY]) == []
    assert await after.take_task_app_key(waiting) == TASK_APP_KEY  # a job still to run keeps its key, in memory


async def test_a_job_waiting_for_resources_says_why_in_its_status_and_events(tmp_path, ray_jobs):
    jobs_manager = manager(tmp_path, ray_jobs)
    job_id = (await jobs_manager.submit(body(), None))["job_id"]
    ray_jobs.status[job_id] = "RUNNING"
    run = jobs_manager.book.run_dir(job_id)
    run.mkdir(parents=True, exist_ok=True)
    reason = "waiting for resources: needs 0.5 CPU for a trainer worker; held by: rlgate-serve (1 CPU)"
    (run / "waiting.json").write_text(json.dumps({"reason": reason, "at": 0.0}))  # what its driver writes
    for _ in range(2):
        await jobs_manager._poll(jobs_manager.book.jobs[job_id])
    status = await jobs_manager.get(job_id, None)
    assert (status["status"], status["waiting"]) == ("running", reason)
    (run / "waiting.json").unlink()  # the resources came free
    await jobs_manager._poll(jobs_manager.book.jobs[job_id])
    assert (await jobs_manager.get(job_id, None))["waiting"] is None
    events = [(e["type"], e["message"]) for e in await jobs_manager.get_events(job_id, None, 0, 100)]
    assert [e for e in events if e[0] == "rl.waiting"] == [("rl.waiting", reason)]  # said once
    assert events[-1][0] == "rl.resources"


async def test_a_jobs_unsaid_cpus_and_engine_are_the_gateways_default_for_jobs(tmp_path, ray_jobs):
    import tomllib

    jobs_manager = manager(tmp_path, ray_jobs, engine="hf")
    unsaid = (await jobs_manager.submit(body(), None))["job_id"]
    said = body(rollout={"num_cpus": 2, "engine": "vllm"}, compute={"cpus_per_worker": 3})
    said = (await jobs_manager.submit(said, None))["job_id"]
    for job_id, cpus, engine in ((unsaid, (0.5, 0.5), "hf"), (said, (2, 3), "vllm")):
        config = tomllib.loads((jobs_manager.book.folder(job_id) / "config.toml").read_text())
        assert (config["rollout"]["num_cpus"], config["compute"]["cpus_per_worker"]) == cpus
        assert config["rollout"]["engine"] == engine


async def test_a_queued_job_says_what_it_waits_for(tmp_path, ray_jobs):
    jobs_manager = manager(tmp_path, ray_jobs, max_running=1)
    first = (await jobs_manager.submit(body(), None))["job_id"]
    second = (await jobs_manager.submit(body(), None))["job_id"]
    assert (await jobs_manager.get(first, None))["waiting"] is None
    queued = await jobs_manager.get(second, None)
    assert queued["status"] == "queued" and queued["waiting"] == (
        "queued: 1 jobs running, as many as [gateway] max_running_jobs allows"
    )
    await jobs_manager.cancel(first, None)
    await jobs_manager._start_queued()
    assert (await jobs_manager.get(second, None))["waiting"] is None and second in ray_jobs.submitted


async def test_a_jobs_tags_are_its_configs_and_its_requests(tmp_path, ray_jobs):
    jobs_manager = manager(tmp_path, ray_jobs)
    request = body(tags={"experiment": "math"}) | {"tags": {"source": "train-cli"}}  # synth-ai's SDK sends both
    job_id = (await jobs_manager.submit(request, None))["job_id"]
    assert (await jobs_manager.get(job_id, None))["tags"] == {"experiment": "math", "source": "train-cli"}


async def test_a_retry_with_the_same_idempotency_key_during_the_first_call_makes_no_second_job(
    tmp_path, ray_jobs, monkeypatch
):
    """A client that times out while its submission's task app is being checked
    (a slow name lookup) and retries with the same Idempotency-Key gets the same
    job, not a second job with a second driver."""
    import asyncio
    import time

    checked = rlgate.actors.job_manager.check_url

    def slow_check(url, allowlist):
        time.sleep(0.2)  # the name lookup, in a thread: other calls run meanwhile
        return checked(url, allowlist)

    monkeypatch.setattr(rlgate.actors.job_manager, "check_url", slow_check)
    jobs_manager = manager(tmp_path, ray_jobs)
    first, retry = await asyncio.gather(jobs_manager.submit(body(), "key-1"), jobs_manager.submit(body(), "key-1"))
    assert first["job_id"] == retry["job_id"] and len(jobs_manager.book.tracked) == 1
    assert (await jobs_manager.submit(body(), "key-1"))["job_id"] == first["job_id"]  # and afterwards


async def test_a_cancel_the_job_manager_died_in_the_middle_of_is_finished_by_its_successor(tmp_path, ray_jobs):
    """A cancel is noted before the job's Ray job is stopped (so a submission in
    flight sees it): an actor that dies in between leaves the driver running,
    holding its resources, while the job reads cancelled. Its successor stops it."""
    jobs_manager = manager(tmp_path, ray_jobs)
    job_id = (await jobs_manager.submit(body(), None))["job_id"]
    await jobs_manager._start_queued()
    ray_jobs.status[job_id] = "RUNNING"
    jobs_manager.book.finish(job_id, "cancelled", None)  # noted; the actor dies before the stop

    successor = manager(tmp_path, ray_jobs)
    await successor._stop_cancelled_still_running()
    assert ray_jobs.status[job_id] == "STOPPED" and successor.book.jobs[job_id].status == "cancelled"
    for task in list(successor._tasks):
        task.cancel()
