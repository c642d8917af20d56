"""JobManager: RL jobs, each run as a Ray job of ``train_driver.py``.

Created (get-if-exists, detached, named ``rlgate-<run name>-jobs``) by the
Gateway whose ``/api/rl/jobs`` routes call it: it carries that gateway's address
and folder, so each gateway application has its own. Owns the jobs, one
:class:`Tracked` record each (the public ``Job``, its key's hash, its events,
its task app's key while held), and the idempotency keys, all kept under ``<jobs_dir>/<job id>/`` (``job.json``,
``events.jsonl``, ``config.toml``, and the run folder ``runs/<job id>``), so a
restarted JobManager (or gateway) picks every job up again from disk.

A job is submitted through Ray's job submission API, so it shows on the Ray
dashboard with its logs. Its driver serves its own gateway under
``/jobs/<id>`` on the cluster's Serve proxy. At most ``max_running`` jobs run
at once; the rest wait as ``queued``. A watcher polls Ray's status and the
run's ``metrics.jsonl`` once a second and turns them into events.

A job's task app must be one the operator allows (``[jobs] task_app_hosts``,
checked after DNS resolution: :mod:`rlgate.jobs.egress`); the job's config gets the
operator's rule, which its driver checks again on every connection. Its
secrets are never on disk: the task app's key stays in this actor's memory
until the job's driver takes it (``train_driver.py --job-manager``) or the job
ends, and the driver makes its gateway's admin key itself. A restart of this
actor loses the keys of jobs whose drivers had not taken them yet; those jobs
fail and say so.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray
from pydantic import ValidationError

from rlgate.config import ConfigError, JobsConfig, dump_config
from rlgate.jobs import schema as jobs
from rlgate.jobs.egress import TargetRefused, check_url
from rlgate.run import NAMESPACE, ROLES, actor_name, app_name, checkpoint_states, checkpoints_dir, end_actors
from rlgate.sessions.manager import SessionError, hash_key, new_key, same_secret
from rlgate.training.placement import cluster_nodes, plan, unplaceable

ROOT = Path(__file__).resolve().parents[1]
LOST_KEY = (
    "the JobManager no longer holds this job's task app key (task_app_api_key): it is kept in memory only, "
    "never on disk, and handed to the job's driver once, so a restart of the JobManager before the driver "
    "took it lost it; submit the job again"
)


@dataclass
class Tracked:
    """One job as the JobManager keeps it: the record its callers read, and what
    only the actor knows (its key's hash, its events, its task app's key)."""

    job: jobs.Job
    key_hash: str  # of the job's own API key
    idempotency_key: str | None = None
    events: list[jobs.Event] = field(default_factory=list)
    seen_step: int = 0  # the last metrics step reported as events
    keyed: bool = False  # given a task app key (saved as a flag: a restart knows what it lost)
    task_app_key: str | None = None  # in memory only, until the job's driver takes it
    submit_failures: int = 0
    poll_misses: int = 0

    @property
    def key_lost(self) -> bool:
        """Given a task app key that a restart of the actor lost before its driver took it."""
        return self.keyed and self.task_app_key is None

    def stored(self) -> dict:
        """What ``job.json`` holds: never the task app's key itself, only whether there was one."""
        return {
            "job": self.job.model_dump(mode="json"),
            "key_hash": self.key_hash,
            "idempotency_key": self.idempotency_key,
            "task_app_key": self.keyed,
        }

    @classmethod
    def restore(cls, stored: dict, events_path: Path) -> Tracked:
        lines = events_path.read_text().splitlines() if events_path.exists() else []
        events = [jobs.Event.model_validate_json(line) for line in lines]
        steps = [e.data.get("step", 0) for e in events if e.type == "rl.iteration.complete"]
        job = jobs.Job.model_validate(stored["job"])
        keyed = bool(stored.get("task_app_key"))
        return cls(job, stored["key_hash"], stored.get("idempotency_key"), events, max(steps, default=0), keyed)


class JobManager:
    def __init__(
        self,
        jobs_dir: str,
        gateway: dict,
        max_running: int = 1,
        jobs_section: dict | None = None,
        name: str = "",
        python: str = sys.executable,
        client=None,
    ) -> None:
        """``name``: this actor's name, which a job's driver asks for its task app's
        key; ``client``: Ray's job API (``JobSubmissionClient``; made on first use)."""
        self.dir = Path(jobs_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.gateway, self.max_running, self.name, self.python = gateway, max_running, name, python
        self.set_jobs_section(jobs_section or {})
        self.tracked: dict[str, Tracked] = {}  # job id -> the job and what only this actor knows of it
        self.idempotency: dict[str, str] = {}  # idempotency key -> job id
        for path in sorted(self.dir.glob("*/job.json")):  # a restart: every job as it was left
            tracked = Tracked.restore(json.loads(path.read_text()), path.parent / "events.jsonl")
            self.tracked[tracked.job.job_id] = tracked
            if tracked.idempotency_key:
                self.idempotency[tracked.idempotency_key] = tracked.job.job_id
            self._adopt_secret_files(tracked)
        self._client = client
        self._watcher: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        for tracked in list(self.tracked.values()):  # a restart lost the keys of jobs that have not started
            job = tracked.job
            if tracked.key_lost and job.status == "queued" and not self._submitted(job.job_id):
                self._finish(job.job_id, "failed", LOST_KEY)

    @property
    def jobs(self) -> dict[str, jobs.Job]:
        """Every job's public record, by id."""
        return {job_id: tracked.job for job_id, tracked in self.tracked.items()}

    def set_jobs_section(self, jobs_section: dict) -> None:
        """The operator's ``[jobs]``: which task apps jobs may call, model names, waits and
        CPUs. The gateway sets it each time it reaches this actor, which may outlive its config."""
        self.jobs_section = JobsConfig.model_validate(jobs_section)

    # --- helpers --------------------------------------------------------------------

    @property
    def client(self):
        from ray.job_submission import JobSubmissionClient

        if self._client is None:  # this cluster's job API (not "auto": several clusters may share a machine)
            self._client = JobSubmissionClient(ray.get_runtime_context().gcs_address)
        return self._client

    def _ensure_watcher(self) -> None:
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch())

    def _folder(self, job_id: str) -> Path:
        return self.dir / job_id

    def _run_dir(self, job_id: str) -> Path:
        return self._folder(job_id) / "runs" / job_id

    def _save(self, job_id: str) -> None:
        path = self._folder(job_id) / "job.json"
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.tracked[job_id].stored()))
        temporary.replace(path)  # a crash leaves the old record or the new one, never half of one

    def _adopt_secret_files(self, tracked: Tracked) -> None:
        """The secret files that versions before this one kept beside a job's records:
        removed, and a task app key still to be used kept in memory instead."""
        folder = self._folder(tracked.job.job_id)
        (folder / "admin_key").unlink(missing_ok=True)
        old = folder / "task_app_key"
        if old.exists():
            if tracked.job.status not in jobs.FINISHED:
                tracked.task_app_key, tracked.keyed = old.read_text(), True
            old.unlink()

    def _event(self, job_id: str, kind: str, message: str, data: dict | None = None) -> None:
        events = self.tracked[job_id].events
        event = jobs.Event(seq=len(events) + 1, type=kind, message=message, created_at=time.time(), data=data or {})
        events.append(event)
        with open(self._folder(job_id) / "events.jsonl", "a") as out:
            out.write(event.model_dump_json() + "\n")

    def _job(self, job_id: str, key: str | None) -> jobs.Job:
        self._ensure_watcher()
        known = {tracked.key_hash for tracked in self.tracked.values()}
        if key is not None and hash_key(key) not in known:  # before 404: ids are not for strangers
            raise SessionError(401, "invalid API key: use the admin key or this job's own key")
        if job_id not in self.tracked:
            raise SessionError(404, f"no job {job_id!r}")
        if key is not None and not same_secret(hash_key(key), self.tracked[job_id].key_hash):
            raise SessionError(403, "this key belongs to another job")
        return self.tracked[job_id].job

    # --- the routes' calls ---------------------------------------------------------------
    # ``key``: None when the caller holds the admin key, else the job key it sent.

    async def submit(self, body: dict, idempotency_key: str | None) -> dict:
        self._ensure_watcher()
        if idempotency_key and idempotency_key in self.idempotency:
            job = self.tracked[self.idempotency[idempotency_key]].job
            return jobs.JobCreated(job_id=job.job_id, status=job.status).model_dump()
        request, config, ignored = await self._vetted(body)
        job_id = "job-" + secrets.token_hex(6)
        key = new_key("rlg-job-")
        self._folder(job_id).mkdir(parents=True)
        gateway = config.gateway
        gateway.run_name, gateway.run_dir = job_id, str(self._run_dir(job_id).parent)
        gateway.host, gateway.port, gateway.route_prefix = self.gateway["host"], self.gateway["port"], job_route(job_id)
        gateway.access_log = False  # a line per request would bury the job's log
        config.tags = {**config.tags, **{str(k): str(v) for k, v in request.tags.items()}}
        dump_config(config, self._folder(job_id) / "config.toml")
        self._record(job_id, key, config, request, idempotency_key)
        if ignored:  # synth-ai keys that change nothing here, each named once
            names = ", ".join(item.split(":", 1)[0] for item in ignored)
            message = f"config keys that change nothing here: {names}"
            self._event(job_id, "rl.config.ignored", message, {"keys": ignored})
        await self._start_queued()
        return jobs.JobCreated(job_id=job_id, status=self.tracked[job_id].job.status, api_key=key).model_dump()

    async def _vetted(self, body: dict):
        """(request, config, ignored keys) of a job this gateway takes; SessionError
        422 says what is wrong: the request, its config, the task app's host, or a
        resource the cluster can never provide."""
        try:
            request = jobs.JobRequest.model_validate(body)
            config, ignored = jobs.job_plan(request)
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
            raise SessionError(422, f"invalid job request: {problems}") from None
        except ConfigError as err:
            raise SessionError(422, f"invalid job config: {err}") from None
        config.jobs = self.jobs_section.model_copy()  # the operator's rule, not the job's; its driver checks it too
        config.model.name = config.jobs.models.get(config.model.name, config.model.name)
        if "num_cpus" not in config.rollout.model_fields_set:  # unsaid: the gateway's default for jobs
            config.rollout.num_cpus = config.jobs.cpus_per_bundle
        if "cpus_per_worker" not in config.compute.model_fields_set:
            config.compute.cpus_per_worker = config.jobs.cpus_per_bundle
        if config.services.task_url is not None:
            try:
                await asyncio.to_thread(check_url, config.services.task_url, config.jobs.allowlist())
            except TargetRefused as err:
                raise SessionError(422, str(err)) from None  # names the host and the setting to change
        gpus = config.compute.gpus_per_worker if config.compute.gpus_per_worker is not None else 0.0
        bundles = plan(config, gpus)
        problem = unplaceable(bundles, cluster_nodes(len(bundles)))  # nodes alive or the autoscaler may add
        if problem:
            raise SessionError(422, problem)
        return request, config, ignored

    def _record(self, job_id: str, key: str, config, request: jobs.JobRequest, idempotency_key: str | None) -> None:
        """The new job, queued: its record, key, events and idempotency key, saved;
        its task app's key in memory only, until the job's driver takes it."""
        job = jobs.Job(
            job_id=job_id,
            status="queued",
            created_at=time.time(),
            tags=config.tags,  # the config's [tags] and the request's (synth-ai sends both)
            metadata=request.metadata,
            model=config.model.name,
            task_app_url=config.services.task_url,
            total_steps=config.training.total_steps,
            progress=jobs.progress([], config.training.total_steps),
        )
        self.tracked[job_id] = Tracked(job, hash_key(key), idempotency_key)
        if request.task_app_api_key:
            self.tracked[job_id].task_app_key, self.tracked[job_id].keyed = request.task_app_api_key, True
        if idempotency_key:
            self.idempotency[idempotency_key] = job_id
        self._save(job_id)
        self._event(job_id, "rl.created", f"job created: {config.model.name}, {config.training.total_steps} steps")

    async def list(self) -> list[dict]:
        self._ensure_watcher()
        return [job.model_dump(mode="json") for job in sorted(self.jobs.values(), key=lambda j: -j.created_at)]

    async def take_task_app_key(self, job_id: str) -> str | None:
        """The job's task app key, for its driver, once: then this actor forgets it.
        None when the job was given none; LookupError when it was and is gone."""
        tracked = self.tracked.get(job_id)
        if tracked is None:
            raise LookupError(f"no job {job_id!r}")
        if tracked.task_app_key is not None:
            key, tracked.task_app_key = tracked.task_app_key, None
            return key
        if tracked.job.status in jobs.FINISHED:  # e.g. cancelled while its driver was starting
            raise LookupError(f"job {job_id} has already {tracked.job.status}")
        if tracked.keyed:
            raise LookupError(LOST_KEY)
        return None

    async def get(self, job_id: str, key: str | None) -> dict:
        self._ensure_watcher()
        return self._job(job_id, key).model_dump(mode="json")

    async def get_events(self, job_id: str, key: str | None, since_seq: int, limit: int) -> list[dict]:
        self._job(job_id, key)
        chosen = [e for e in self.tracked[job_id].events if e.seq > since_seq][:limit]
        return [e.model_dump(mode="json") for e in chosen]

    async def get_metrics(self, job_id: str, key: str | None, after_step: int) -> list[dict]:
        self._job(job_id, key)
        return [m for m in self._metrics(job_id) if m["step"] > after_step]

    async def cancel(self, job_id: str, key: str | None) -> dict:
        job = self._job(job_id, key)
        if job.status in jobs.FINISHED:
            raise SessionError(409, f"job {job_id} has already {job.status}")
        self._finish(job_id, "cancelled", None)  # first: a submission in flight sees it and stops its job
        if self._submitted(job_id) or await self._known_to_ray(job_id):
            await self._stop(job_id)
        return job.model_dump(mode="json")

    async def _stop(self, job_id: str) -> None:
        """Stop the job's Ray job; tidy up once it has ended (the driver cleans up
        after itself on SIGTERM, but not if it is killed first)."""
        try:
            await asyncio.to_thread(self.client.stop_job, job_id)
        except Exception as err:  # already gone: nothing to stop
            print(f"rlgate jobs: could not stop {job_id}: {err}", file=sys.stderr)
        self._spawn(self._tidy_after_stop(job_id))

    def _spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)  # keep a reference until it is done
        task.add_done_callback(self._tasks.discard)

    async def _tidy_after_stop(self, job_id: str) -> None:
        for _ in range(120):
            if not await self._known_to_ray(job_id):
                break
            info = await asyncio.to_thread(self.client.get_job_info, job_id)
            if info.status.is_terminal():
                break
            await asyncio.sleep(1.0)
        await self._drop_leftovers(job_id)

    # --- running jobs --------------------------------------------------------------------

    def _submitted(self, job_id: str) -> bool:
        return (self._folder(job_id) / "submitted").exists()

    async def _start_queued(self) -> None:
        running = sum(
            1
            for j in self.jobs.values()
            if j.status == "running" or (j.status == "queued" and self._submitted(j.job_id))
        )
        for job in sorted(self.jobs.values(), key=lambda j: j.created_at):
            if job.status != "queued" or self._submitted(job.job_id):
                continue
            if running >= self.max_running:  # it says why it waits
                job.waiting = f"queued: {running} jobs running, as many as [gateway] max_running_jobs allows"
                continue
            job.waiting = None
            await self._submit_to_ray(job)
            running += self._submitted(job.job_id)

    async def _submit_to_ray(self, job: jobs.Job) -> None:
        if self.tracked[job.job_id].key_lost:  # lost in a restart
            self._finish(job.job_id, "failed", LOST_KEY)
            return
        folder = self._folder(job.job_id)
        config_path = folder / "config.toml"
        # No secret in the entrypoint, env vars or metadata (Ray shows them all in its job info), nor in a
        # file: the driver makes its gateway's admin key itself and takes the task app's key from us.
        entrypoint = shlex.join(
            [self.python, str(ROOT / "train_driver.py"), "--config", str(config_path), "--job-manager", self.name]
        )
        env = {
            "PYTHONPATH": str(ROOT),
            "RAY_JOB_STOP_WAIT_TIME_S": "60",  # time for a cancelled driver to stop its engines and trainer
        }
        try:
            await asyncio.to_thread(
                self.client.submit_job,
                entrypoint=f"cd {shlex.quote(str(ROOT))} && {entrypoint}",
                submission_id=job.job_id,
                runtime_env={"env_vars": env},
                metadata={"rlgate_job": job.job_id},
            )
        except Exception as err:  # e.g. "no available agent" while the cluster starts: retry for a minute
            if await self._known_to_ray(job.job_id):  # submitted before a restart cut us short
                (self._folder(job.job_id) / "submitted").touch()
                return
            tracked = self.tracked[job.job_id]
            tracked.submit_failures += 1
            if (tries := tracked.submit_failures) >= 60:
                self._finish(job.job_id, "failed", f"Ray's job API refused the job {tries} times: {err}")
            return
        (folder / "submitted").touch()
        if job.status == "cancelled":  # cancelled while it was being submitted
            await self._stop(job.job_id)

    async def _known_to_ray(self, job_id: str) -> bool:
        try:
            await asyncio.to_thread(self.client.get_job_info, job_id)
        except Exception:  # no such job (or the job API is still starting)
            return False
        return True

    def _metrics(self, job_id: str) -> list[dict]:
        path = self._run_dir(job_id) / "metrics.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        parsed = [json.loads(line) for line in lines if line.strip().endswith("}")]  # a line being written waits
        # NaN or infinity (a diverged loss) is not JSON: such a figure is reported as null
        return [{k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in m.items()} for m in parsed]

    def _results(self, job_id: str) -> jobs.JobResults:
        metrics = self._metrics(job_id)
        found = []
        for folder, state in checkpoint_states(checkpoints_dir(self._run_dir(job_id))).items():
            found.append(jobs.Checkpoint(step=state["driver"]["step"], path=str(folder / "model")))
        found.sort(key=lambda c: c.step)
        return jobs.JobResults(
            final_reward=metrics[-1]["reward_mean"] if metrics else None,
            checkpoints=found,
            model_path=found[-1].path if found else None,
        )

    def _finish(self, job_id: str, status: str, error: str | None) -> None:
        tracked = self.tracked[job_id]
        tracked.task_app_key = None  # however it ended: a key its driver never took goes too
        job = tracked.job
        if job.status in jobs.FINISHED:
            return
        self._catch_up(job_id)
        job.status, job.error, job.finished_at = status, error, time.time()
        job.results = self._results(job_id)
        message = {"succeeded": "job succeeded", "cancelled": "job cancelled"}.get(status, f"job failed: {error}")
        self._event(job_id, f"rl.{status}", message, job.results.model_dump(mode="json"))
        self._save(job_id)

    def _catch_up(self, job_id: str) -> None:
        """Events and progress for metrics lines not yet reported."""
        tracked, metrics = self.tracked[job_id], self._metrics(job_id)
        job = tracked.job
        for line in metrics:
            if line["step"] > tracked.seen_step:
                for kind, message, data in jobs.step_events(line):
                    self._event(job_id, kind, message, data)
                tracked.seen_step = line["step"]
        job.progress = jobs.progress(metrics, job.total_steps)

    async def _watch(self) -> None:
        while True:
            for job in [j for j in self.jobs.values() if j.status not in jobs.FINISHED and self._submitted(j.job_id)]:
                try:
                    await self._poll(job)
                except Exception as err:  # the job API is briefly unavailable: try again next time
                    print(f"rlgate jobs: could not poll {job.job_id}: {err}", file=sys.stderr)
            await self._start_queued()
            await asyncio.sleep(1.0)

    async def _poll(self, job: jobs.Job) -> None:
        if not await self._known_to_ray(job.job_id):
            tracked = self.tracked[job.job_id]
            tracked.poll_misses += 1
            if tracked.poll_misses >= 30:  # half a minute: the cluster restarted without it
                self._finish(job.job_id, "failed", "Ray no longer knows this job (was the cluster restarted?)")
                await self._drop_leftovers(job.job_id)
            return
        self.tracked[job.job_id].poll_misses = 0
        info = await asyncio.to_thread(self.client.get_job_info, job.job_id)
        status = jobs.RAY_STATUS.get(info.status.value, "queued")
        if status == "running" and job.status == "queued":
            job.status, job.started_at = "running", time.time()
            self._event(job.job_id, "rl.running", "job running")
        if status in jobs.FINISHED:
            error = None
            if status == "failed":
                error = _last_line(await asyncio.to_thread(self.client.get_job_logs, job.job_id)) or info.message
            self._finish(job.job_id, status, error)
            await self._drop_leftovers(job.job_id)
            return
        self._note_waiting(job)
        self._catch_up(job.job_id)
        self._save(job.job_id)

    def _note_waiting(self, job: jobs.Job) -> None:
        """Why the job's driver waits for resources (its waiting.json): in its status, and an event per change."""
        path = self._run_dir(job.job_id) / "waiting.json"
        try:
            reason = json.loads(path.read_text())["reason"] if path.exists() else None
        except (OSError, ValueError, KeyError):  # being written: look again next time
            return
        if reason != job.waiting:
            job.waiting = reason
            if reason is not None:
                self._event(job.job_id, "rl.waiting", reason)
            else:
                self._event(job.job_id, "rl.resources", "the resources it waited for are free: starting")

    async def _drop_leftovers(self, job_id: str) -> None:
        """A finished job's Serve app (left behind if its driver was killed before
        its own cleanup) and its run's detached actors; its files stay."""
        from ray import serve

        app = app_name(job_id, job_route(job_id))
        try:
            if app in serve.status().applications:
                await asyncio.to_thread(serve.delete, app, False)
        except Exception as err:
            print(f"rlgate jobs: could not remove the Serve app of {job_id}: {err}", file=sys.stderr)
        await asyncio.to_thread(end_actors, job_id, ROLES, 0.0)


def job_route(job_id: str) -> str:
    """Where a job's own gateway is served (its run is named by the job id)."""
    return f"/jobs/{job_id}"


def _last_line(logs: str) -> str | None:
    """The driver's own one-line reason (``rlgate: ...``), else the last line of its logs."""
    from rlgate.training.tasks import redact

    lines = [redact(line.strip()) for line in logs.splitlines() if line.strip()]
    ours = [line for line in lines if line.startswith("rlgate: ") and ("fail" in line or "stopped" in line)]
    if ours:
        return ours[-1].removeprefix("rlgate: ")
    return lines[-1] if lines else None


def get_or_create_job_manager(
    run_name: str, jobs_dir: str, gateway: dict, max_running: int = 1, jobs_section: dict | None = None
):
    name = actor_name(run_name, "jobs")
    manager = (
        ray.remote(JobManager)
        .options(name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0)
        .remote(jobs_dir, gateway, max_running, jobs_section, name)
    )
    manager.set_jobs_section.remote(jobs_section or {})  # one made earlier keeps its own until told
    return manager
