"""JobManager: RL jobs, each run as a Ray job of the training driver (``python -m rlgate.training.driver``).

Created (get-if-exists, detached, named ``rlgate-<run name>-jobs``) by the
Gateway whose ``/api/rl/jobs`` routes call it: it carries that gateway's address
and folder, so each gateway application has its own. Owns the jobs through a
:class:`rlgate.jobs.book.JobBook` (their records, events and idempotency keys,
on disk under ``<jobs_dir>/<job id>/``), so a restarted JobManager (or gateway)
picks every job up again; this actor is the part that talks to Ray.

A job is submitted through Ray's job submission API, so it shows on the Ray
dashboard with its logs. Its driver serves its own gateway under
``/jobs/<id>`` on the cluster's Serve proxy. At most ``max_running`` jobs run
at once; the rest wait as ``queued``. A watcher polls Ray's status and the
run's ``metrics.jsonl`` once a second and turns them into events.

A job's task app must be one the operator allows (``[jobs] task_app_hosts``,
checked after DNS resolution: :mod:`rlgate.jobs.egress`); the job's config gets the
operator's rule, which its driver checks again on every connection. Its
secrets are never on disk: the task app's key stays in this actor's memory
until the job's driver takes it (``--job-manager``) or the job
ends, and the driver makes its gateway's admin key itself. A restart of this
actor loses the keys of jobs whose drivers had not taken them yet; those jobs
fail and say so.
"""

from __future__ import annotations

import asyncio
import secrets
import shlex
import sys
import time

import ray
from pydantic import ValidationError

from rlgate.config import ConfigError, JobsConfig, dump_config
from rlgate.jobs import schema as jobs
from rlgate.jobs.book import LOST_KEY, JobBook, job_route, last_line
from rlgate.jobs.egress import TargetRefused, check_url
from rlgate.run import NAMESPACE, ROLES, actor_name, app_name, end_actors
from rlgate.sessions.manager import SessionError, new_key
from rlgate.training.placement import cluster_nodes, plan, unplaceable

CANCEL_RECHECK_S = 24 * 3600.0  # how far back a (re)started JobManager looks for cancelled jobs still running


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
        self.book = JobBook(jobs_dir)
        self.gateway, self.max_running, self.name, self.python = gateway, max_running, name, python
        self.set_jobs_section(jobs_section or {})
        self._client = client
        self._watcher: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._submitting: dict[str, asyncio.Future] = {}  # idempotency key -> its first call, while it runs
        for tracked in list(self.book.tracked.values()):  # a restart lost the keys of jobs that have not started
            job = tracked.job
            if tracked.key_lost and job.status == "queued" and not self.book.submitted(job.job_id):
                self.book.finish(job.job_id, "failed", LOST_KEY)

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

    def _job(self, job_id: str, key: str | None) -> jobs.Job:
        self._ensure_watcher()
        return self.book.job(job_id, key)

    def _ensure_watcher(self) -> None:
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch())

    # --- the routes' calls ---------------------------------------------------------------
    # ``key``: None when the caller holds the admin key, else the job key it sent.

    async def submit(self, body: dict, idempotency_key: str | None) -> dict:
        """A new job, or the one ``idempotency_key`` already made; a retry that comes
        while the first call is still being checked (its task app's name resolved,
        say) waits for that call's answer rather than make a second job."""
        if not idempotency_key:
            return await self._submit(body, None)
        first = self._submitting.get(idempotency_key)
        if first is None:
            first = self._submitting[idempotency_key] = asyncio.ensure_future(self._submit(body, idempotency_key))
            first.add_done_callback(lambda _: self._submitting.pop(idempotency_key, None))
        return await asyncio.shield(first)

    async def _submit(self, body: dict, idempotency_key: str | None) -> dict:
        self._ensure_watcher()
        if idempotency_key and idempotency_key in self.book.idempotency:
            job = self.book.tracked[self.book.idempotency[idempotency_key]].job
            return jobs.JobCreated(job_id=job.job_id, status=job.status).model_dump()
        request, config, ignored = await self._vetted(body)
        job_id = "job-" + secrets.token_hex(6)
        key = new_key("rlg-job-")
        self.book.folder(job_id).mkdir(parents=True)
        gateway = config.gateway
        gateway.run_name, gateway.run_dir = job_id, str(self.book.run_dir(job_id).parent)
        gateway.host, gateway.port, gateway.route_prefix = self.gateway["host"], self.gateway["port"], job_route(job_id)
        gateway.access_log = False  # a line per request would bury the job's log
        config.tags = {**config.tags, **{str(k): str(v) for k, v in request.tags.items()}}
        dump_config(config, self.book.folder(job_id) / "config.toml")
        self.book.record(job_id, key, config, request, idempotency_key)
        if ignored:  # synth-ai keys that change nothing here, each named once
            names = ", ".join(item.split(":", 1)[0] for item in ignored)
            message = f"config keys that change nothing here: {names}"
            self.book.event(job_id, "rl.config.ignored", message, {"keys": ignored})
        await self._start_queued()
        return jobs.JobCreated(job_id=job_id, status=self.book.tracked[job_id].job.status, api_key=key).model_dump()

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
        if "engine" not in config.rollout.model_fields_set:  # unsaid: the gateway's default for jobs
            config.rollout.engine = config.jobs.engine
        if "num_cpus" not in config.rollout.model_fields_set:
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

    async def list(self) -> list[dict]:
        self._ensure_watcher()
        return [job.model_dump(mode="json") for job in sorted(self.book.jobs.values(), key=lambda j: -j.created_at)]

    async def take_task_app_key(self, job_id: str) -> str | None:
        """The job's task app key, for its driver, once (:meth:`JobBook.take_task_app_key`)."""
        return self.book.take_task_app_key(job_id)

    async def get(self, job_id: str, key: str | None) -> dict:
        self._ensure_watcher()
        return self._job(job_id, key).model_dump(mode="json")

    async def get_events(self, job_id: str, key: str | None, since_seq: int, limit: int) -> list[dict]:
        self._job(job_id, key)
        chosen = [e for e in self.book.tracked[job_id].events if e.seq > since_seq][:limit]
        return [e.model_dump(mode="json") for e in chosen]

    async def get_metrics(self, job_id: str, key: str | None, after_step: int) -> list[dict]:
        self._job(job_id, key)
        return [m for m in self.book.metrics(job_id) if m["step"] > after_step]

    async def cancel(self, job_id: str, key: str | None) -> dict:
        job = self._job(job_id, key)
        if job.status in jobs.FINISHED:
            raise SessionError(409, f"job {job_id} has already {job.status}")
        self.book.finish(job_id, "cancelled", None)  # first: a submission in flight sees it and stops its job
        if self.book.submitted(job_id) or await self._known_to_ray(job_id):
            await self._stop(job_id)
        return job.model_dump(mode="json")

    async def _stop(self, job_id: str) -> None:
        """Stop the job's Ray job; tidy up once it has ended (the driver cleans up
        after itself on SIGTERM, but not if it is killed first)."""
        await self._stop_ray_job(job_id)
        self._spawn(self._tidy_after_stop(job_id))

    def _spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)  # keep a reference until it is done
        task.add_done_callback(self._tasks.discard)

    async def _tidy_after_stop(self, job_id: str) -> None:
        for second in range(120):
            if not await self._known_to_ray(job_id):
                break
            info = await asyncio.to_thread(self.client.get_job_info, job_id)
            if info.status.is_terminal():
                break
            if second and second % 10 == 0:  # the stop may have failed (the job API briefly down): again
                await self._stop_ray_job(job_id)
            await asyncio.sleep(1.0)
        await self._drop_leftovers(job_id)

    async def _stop_ray_job(self, job_id: str) -> None:
        try:
            await asyncio.to_thread(self.client.stop_job, job_id)
        except Exception as err:  # already gone: nothing to stop
            print(f"rlgate jobs: could not stop {job_id}: {err}", file=sys.stderr)

    async def _stop_cancelled_still_running(self) -> None:
        """Jobs cancelled lately whose driver still runs: this actor may have died
        between noting a cancel and stopping its Ray job (the cancel is noted first)."""
        recent = time.time() - CANCEL_RECHECK_S
        for job in [j for j in self.book.jobs.values() if j.status == "cancelled" and (j.finished_at or 0) > recent]:
            if not self.book.submitted(job.job_id) or not await self._known_to_ray(job.job_id):
                continue
            info = await asyncio.to_thread(self.client.get_job_info, job.job_id)
            if not info.status.is_terminal():
                print(f"rlgate jobs: {job.job_id} was cancelled but still runs; stopping it", file=sys.stderr)
                await self._stop(job.job_id)

    # --- running jobs --------------------------------------------------------------------

    async def _start_queued(self) -> None:
        running = sum(
            1
            for j in self.book.jobs.values()
            if j.status == "running" or (j.status == "queued" and self.book.submitted(j.job_id))
        )
        for job in sorted(self.book.jobs.values(), key=lambda j: j.created_at):
            if job.status != "queued" or self.book.submitted(job.job_id):
                continue
            if running >= self.max_running:  # it says why it waits
                job.waiting = f"queued: {running} jobs running, as many as [gateway] max_running_jobs allows"
                continue
            job.waiting = None
            await self._submit_to_ray(job)
            running += self.book.submitted(job.job_id)

    async def _submit_to_ray(self, job: jobs.Job) -> None:
        if self.book.tracked[job.job_id].key_lost:  # lost in a restart
            self.book.finish(job.job_id, "failed", LOST_KEY)
            return
        config_path = self.book.folder(job.job_id) / "config.toml"
        # No secret in the entrypoint, env vars or metadata (Ray shows them all in its job info), nor in a
        # file: the driver makes its gateway's admin key itself and takes the task app's key from us.
        # The installed package's driver: no checkout needed, and the cwd is the job's own.
        entrypoint = shlex.join(
            [self.python, "-m", "rlgate.training.driver", "--config", str(config_path), "--job-manager", self.name]
        )
        env = {"RAY_JOB_STOP_WAIT_TIME_S": "60"}  # time for a cancelled driver to stop its engines and trainer
        try:
            await asyncio.to_thread(
                self.client.submit_job,
                entrypoint=entrypoint,
                submission_id=job.job_id,
                runtime_env={"env_vars": env},
                metadata={"rlgate_job": job.job_id},
            )
        except Exception as err:  # e.g. "no available agent" while the cluster starts: retry for a minute
            if await self._known_to_ray(job.job_id):  # submitted before a restart cut us short
                self.book.mark_submitted(job.job_id)
                return
            tracked = self.book.tracked[job.job_id]
            tracked.submit_failures += 1
            if (tries := tracked.submit_failures) >= 60:
                self.book.finish(job.job_id, "failed", f"Ray's job API refused the job {tries} times: {err}")
            return
        self.book.mark_submitted(job.job_id)
        if job.status == "cancelled":  # cancelled while it was being submitted
            await self._stop(job.job_id)

    async def _known_to_ray(self, job_id: str) -> bool:
        try:
            await asyncio.to_thread(self.client.get_job_info, job_id)
        except Exception:  # no such job (or the job API is still starting)
            return False
        return True

    async def _watch(self) -> None:
        try:
            await self._stop_cancelled_still_running()
        except Exception as err:  # the job API is briefly unavailable: the cancel stays noted
            print(f"rlgate jobs: could not check cancelled jobs: {err}", file=sys.stderr)
        while True:
            unfinished = [j for j in self.book.jobs.values() if j.status not in jobs.FINISHED]
            for job in [j for j in unfinished if self.book.submitted(j.job_id)]:  # no file look-up for old jobs
                try:
                    await self._poll(job)
                except Exception as err:  # the job API is briefly unavailable: try again next time
                    print(f"rlgate jobs: could not poll {job.job_id}: {err}", file=sys.stderr)
            await self._start_queued()
            await asyncio.sleep(1.0)

    async def _poll(self, job: jobs.Job) -> None:
        if not await self._known_to_ray(job.job_id):
            tracked = self.book.tracked[job.job_id]
            tracked.poll_misses += 1
            if tracked.poll_misses >= 30:  # half a minute: the cluster restarted without it
                self.book.finish(job.job_id, "failed", "Ray no longer knows this job (was the cluster restarted?)")
                await self._drop_leftovers(job.job_id)
            return
        self.book.tracked[job.job_id].poll_misses = 0
        info = await asyncio.to_thread(self.client.get_job_info, job.job_id)
        status = jobs.RAY_STATUS.get(info.status.value, "queued")
        if status == "running" and job.status == "queued":
            job.status, job.started_at = "running", time.time()
            self.book.event(job.job_id, "rl.running", "job running")
        if status in jobs.FINISHED:
            error = None
            if status == "failed":
                error = last_line(await asyncio.to_thread(self.client.get_job_logs, job.job_id)) or info.message
            self.book.finish(job.job_id, status, error)
            await self._drop_leftovers(job.job_id)
            return
        self.book.note_waiting(job)
        self.book.catch_up(job.job_id)
        self.book.save(job.job_id)

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
