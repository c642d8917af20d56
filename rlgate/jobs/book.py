"""The jobs' book: every job's record, events and idempotency key, in memory and
under ``<jobs_dir>/<job id>/`` (``job.json``, ``events.jsonl``, ``config.toml``
and the run folder ``runs/<job id>``), so a restarted JobManager picks every job
up again from disk. Pure logic, no Ray: :class:`rlgate.actors.job_manager.JobManager`
keeps one and talks to Ray's job API.

A job's task app key is never on disk: it stays in memory until the job's driver
takes it, and a restart loses it (the job then fails and says so)."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlgate.jobs import schema as jobs
from rlgate.run import checkpoint_states, checkpoint_weights, checkpoints_dir
from rlgate.sessions.manager import SessionError, hash_key, redact, same_secret

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
    seen_evals: int = 0  # evaluations (lines of eval.jsonl) reported as events
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
        return cls(
            job,
            stored["key_hash"],
            idempotency_key=stored.get("idempotency_key"),
            events=events,
            seen_step=max(steps, default=0),
            seen_evals=sum(e.type == "rl.evaluation.complete" for e in events),
            keyed=bool(stored.get("task_app_key")),
        )


class JobBook:
    def __init__(self, jobs_dir: str | Path) -> None:
        self.dir = Path(jobs_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.tracked: dict[str, Tracked] = {}  # job id -> the job and what only this actor knows of it
        self.idempotency: dict[str, str] = {}  # idempotency key -> job id
        for path in sorted(self.dir.glob("*/job.json")):  # a restart: every job as it was left
            tracked = Tracked.restore(json.loads(path.read_text()), path.parent / "events.jsonl")
            self.tracked[tracked.job.job_id] = tracked
            if tracked.idempotency_key:
                self.idempotency[tracked.idempotency_key] = tracked.job.job_id
            self._adopt_secret_files(tracked)

    @property
    def jobs(self) -> dict[str, jobs.Job]:
        """Every job's public record, by id."""
        return {job_id: tracked.job for job_id, tracked in self.tracked.items()}

    def folder(self, job_id: str) -> Path:
        return self.dir / job_id

    def run_dir(self, job_id: str) -> Path:
        return self.folder(job_id) / "runs" / job_id

    def submitted(self, job_id: str) -> bool:
        """Handed to Ray's job API (a flag file: it outlives the actor)."""
        return (self.folder(job_id) / "submitted").exists()

    def mark_submitted(self, job_id: str) -> None:
        (self.folder(job_id) / "submitted").touch()

    def save(self, job_id: str) -> None:
        path = self.folder(job_id) / "job.json"
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.tracked[job_id].stored()))
        temporary.replace(path)  # a crash leaves the old record or the new one, never half of one

    def _adopt_secret_files(self, tracked: Tracked) -> None:
        """The secret files that versions before this one kept beside a job's records:
        removed, and a task app key still to be used kept in memory instead."""
        folder = self.folder(tracked.job.job_id)
        (folder / "admin_key").unlink(missing_ok=True)
        old = folder / "task_app_key"
        if old.exists():
            if tracked.job.status not in jobs.FINISHED:
                tracked.task_app_key, tracked.keyed = old.read_text(), True
            old.unlink()

    def event(self, job_id: str, kind: str, message: str, data: dict | None = None) -> None:
        events = self.tracked[job_id].events
        event = jobs.Event(seq=len(events) + 1, type=kind, message=message, created_at=time.time(), data=data or {})
        events.append(event)
        with open(self.folder(job_id) / "events.jsonl", "a") as out:
            out.write(event.model_dump_json() + "\n")

    def job(self, job_id: str, key: str | None) -> jobs.Job:
        """The job ``key`` may see (None: the admin key): 401 for an unknown key, 404
        for an unknown job, 403 for another job's key."""
        known = {tracked.key_hash for tracked in self.tracked.values()}
        if key is not None and hash_key(key) not in known:  # before 404: ids are not for strangers
            raise SessionError(401, "invalid API key: use the admin key or this job's own key")
        if job_id not in self.tracked:
            raise SessionError(404, f"no job {job_id!r}")
        if key is not None and not same_secret(hash_key(key), self.tracked[job_id].key_hash):
            raise SessionError(403, "this key belongs to another job")
        return self.tracked[job_id].job

    def record(self, job_id: str, key: str, config, request: jobs.JobRequest, idempotency_key: str | None) -> None:
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
        self.save(job_id)
        self.event(job_id, "rl.created", f"job created: {config.model.name}, {config.training.total_steps} steps")

    def take_task_app_key(self, job_id: str) -> str | None:
        """The job's task app key, for its driver, once: then it is forgotten.
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

    # --- what the job's driver writes: metrics, checkpoints, why it waits ---------------

    def metrics(self, job_id: str) -> list[dict]:
        return self.lines(job_id, "metrics.jsonl")

    def lines(self, job_id: str, name: str) -> list[dict]:
        """The whole JSON lines of a file the job's driver appends to (metrics.jsonl, eval.jsonl)."""
        path = self.run_dir(job_id) / name
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        parsed = [json.loads(line) for line in lines if line.strip().endswith("}")]  # a line being written waits
        # NaN or infinity (a diverged loss) is not JSON: such a figure is reported as null
        return [{k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in m.items()} for m in parsed]

    def results(self, job_id: str) -> jobs.JobResults:
        metrics = self.metrics(job_id)
        found = []
        for folder, state in checkpoint_states(checkpoints_dir(self.run_dir(job_id))).items():
            found.append(jobs.Checkpoint(step=state["driver"]["step"], path=str(checkpoint_weights(folder))))
        found.sort(key=lambda c: c.step)
        return jobs.JobResults(
            final_reward=metrics[-1]["reward_mean"] if metrics else None,
            checkpoints=found,
            model_path=found[-1].path if found else None,
        )

    def finish(self, job_id: str, status: str, error: str | None) -> None:
        tracked = self.tracked[job_id]
        tracked.task_app_key = None  # however it ended: a key its driver never took goes too
        job = tracked.job
        if job.status in jobs.FINISHED:
            return
        self.catch_up(job_id)
        job.status, job.error, job.finished_at = status, error, time.time()
        job.results = self.results(job_id)
        message = {"succeeded": "job succeeded", "cancelled": "job cancelled"}.get(status, f"job failed: {error}")
        self.event(job_id, f"rl.{status}", message, job.results.model_dump(mode="json"))
        self.save(job_id)

    def catch_up(self, job_id: str) -> None:
        """Events and progress for metrics lines not yet reported."""
        tracked, metrics = self.tracked[job_id], self.metrics(job_id)
        job = tracked.job
        for line in metrics:
            if line["step"] > tracked.seen_step:
                for kind, message, data in jobs.step_events(line):
                    self.event(job_id, kind, message, data)
                tracked.seen_step = line["step"]
        evaluations = self.lines(job_id, "eval.jsonl")
        for line in evaluations[tracked.seen_evals :]:
            self.event(job_id, *jobs.evaluation_event(line))
        tracked.seen_evals = max(tracked.seen_evals, len(evaluations))
        job.progress = jobs.progress(metrics, job.total_steps)

    def note_waiting(self, job: jobs.Job) -> None:
        """Why the job's driver waits for resources (its waiting.json): in its status, and an event per change."""
        path = self.run_dir(job.job_id) / "waiting.json"
        try:
            reason = json.loads(path.read_text())["reason"] if path.exists() else None
        except (OSError, ValueError, KeyError):  # being written: look again next time
            return
        if reason != job.waiting:
            job.waiting = reason
            if reason is not None:
                self.event(job.job_id, "rl.waiting", reason)
            else:
                self.event(job.job_id, "rl.resources", "the resources it waited for are free: starting")


def job_route(job_id: str) -> str:
    """Where a job's own gateway is served (its run is named by the job id)."""
    return f"/jobs/{job_id}"


def last_line(logs: str) -> str | None:
    """The driver's own one-line reason (``rlgate: ...``), else the last line of its logs."""
    lines = [redact(line.strip()) for line in logs.splitlines() if line.strip()]
    ours = [line for line in lines if line.startswith("rlgate: ") and ("fail" in line or "stopped" in line)]
    if ours:
        return ours[-1].removeprefix("rlgate: ")
    return lines[-1] if lines else None
