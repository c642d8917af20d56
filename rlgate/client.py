"""The Python SDK: RL jobs (as synth-ai's ``RLJob``) and sessions (as AReaL's flow).

    job = RLJob.from_config("configs/taskapp-math.toml", backend_url=URL, api_key=ADMIN_KEY,
                            task_app_url="http://127.0.0.1:8201")
    job.submit()
    final = job.poll_until_complete(timeout=3600, on_status=print)
    print(job.get_results()["final_reward"])

    with Session.start(URL, ADMIN_KEY, task_id="math-17") as session:
        reply = session.openai_client().chat.completions.create(model="default", messages=[...])
        session.set_reward(1.0)

Every call raises :class:`RLGateError` with the server's message on a 4xx/5xx.
"""

from __future__ import annotations

import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

FINISHED = ("succeeded", "failed", "cancelled")


class RLGateError(Exception):
    """A refused request: ``status`` is the HTTP status (0: the server was unreachable)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def _call(method: str, url: str, api_key: str, timeout: float = 60.0, **kwargs) -> Any:
    headers = {"Authorization": f"Bearer {api_key}", **kwargs.pop("headers", {})}
    try:
        answer = httpx.request(method, url, headers=headers, timeout=timeout, **kwargs)
    except httpx.HTTPError as err:
        raise RLGateError(0, f"{method} {url}: unreachable ({err.__class__.__name__}: {err})") from None
    if answer.status_code >= 400:
        try:
            message = answer.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = answer.text[:500]
        raise RLGateError(answer.status_code, f"{answer.status_code}: {message}")
    return answer.json()


def list_jobs(backend_url: str, api_key: str) -> list[dict]:
    """Every job on the gateway, newest first (the admin key)."""
    return _call("GET", f"{backend_url.rstrip('/')}/api/rl/jobs", api_key)


class RLJob:
    """One RL job on an rlgate gateway (``/api/rl/jobs``)."""

    def __init__(
        self,
        backend_url: str,
        api_key: str,
        payload: dict | None = None,
        idempotency_key: str | None = None,
        job_id: str | None = None,
    ) -> None:
        self.backend_url, self.api_key = backend_url.rstrip("/"), api_key
        self.payload, self.idempotency_key, self.job_id = payload, idempotency_key, job_id
        self.job_api_key: str | None = None  # this job's own key, returned by submit()

    @classmethod
    def from_config(
        cls,
        config_path: str | Path,
        backend_url: str,
        api_key: str,
        task_app_url: str | None = None,
        idempotency_key: str | None = None,
        model: str | None = None,
        overrides: dict | None = None,
        task_app_api_key: str | None = None,
    ) -> RLJob:
        """A job for the TOML at ``config_path`` (synth-ai's shape or ours),
        sent in synth-ai's payload shape; ``task_app_url`` overrides ``[services] task_url``;
        ``task_app_api_key`` is the task app's environment key (kept out of the job's records)."""
        path = Path(config_path)
        try:
            config = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise RLGateError(0, f"{path}: no such config file") from None
        except tomllib.TOMLDecodeError as err:
            raise RLGateError(0, f"{path}: not valid TOML: {err}") from None
        for section, values in (overrides or {}).items():
            config.setdefault(section, {}).update(values)
        data: dict[str, Any] = {"config": config}
        if task_app_url:
            data["endpoint_base_url"] = task_app_url
        if model:
            data["model"] = model
        payload = {"job_type": "rl", "data": data, "metadata": {"config_path": str(path)}}
        if task_app_api_key:
            payload["task_app_api_key"] = task_app_api_key
        return cls(backend_url, api_key, payload, idempotency_key)

    @classmethod
    def from_job_id(cls, job_id: str, backend_url: str, api_key: str) -> RLJob:
        return cls(backend_url, api_key, job_id=job_id)

    def _url(self, suffix: str = "") -> str:
        if self.job_id is None:
            raise RLGateError(0, "this job is not submitted yet; call submit() first")
        return f"{self.backend_url}/api/rl/jobs/{self.job_id}{suffix}"

    def submit(self) -> str:
        """Create the job; with an idempotency key a resubmission returns the same job. Returns its id."""
        if self.payload is None:
            raise RLGateError(0, "nothing to submit: this job was made from an id")
        headers = {"Idempotency-Key": self.idempotency_key} if self.idempotency_key else {}
        created = _call("POST", f"{self.backend_url}/api/rl/jobs", self.api_key, json=self.payload, headers=headers)
        self.job_id, self.job_api_key = created["job_id"], created.get("api_key")
        return self.job_id

    def get_status(self) -> dict:
        return _call("GET", self._url(), self.api_key)

    def events(self, since_seq: int = 0, limit: int = 200) -> list[dict]:
        return _call("GET", self._url("/events"), self.api_key, params={"since_seq": since_seq, "limit": limit})

    def metrics(self, after_step: int = 0) -> list[dict]:
        return _call("GET", self._url("/metrics"), self.api_key, params={"after_step": after_step})["points"]

    def cancel(self) -> dict:
        return _call("POST", self._url("/cancel"), self.api_key)

    def poll_until_complete(
        self, timeout: float = 3600.0, interval: float = 5.0, on_status: Callable[[dict], None] | None = None
    ) -> dict:
        """Poll until the job has finished (any of succeeded, failed, cancelled); its last status.
        TimeoutError after ``timeout`` seconds (the job keeps running)."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.get_status()
            if on_status is not None:
                on_status(status)
            if status["status"] in FINISHED:
                return status
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {self.job_id} still {status['status']} after {timeout:g} s")
            time.sleep(interval)

    def get_results(self) -> dict:
        """``final_reward``, ``checkpoints`` ([{step, path}]) and ``model_path`` of a finished job."""
        return self.get_status()["results"]


class Session:
    """One gateway session: start it, point an OpenAI client at it, reward it, end it.
    As a context manager it ends the session on exit (as failed if the block raised)."""

    def __init__(self, url: str, admin_key: str, started: dict, task_id: str) -> None:
        self.url, self.admin_key, self.task_id = url.rstrip("/"), admin_key, task_id
        self.session_id, self.api_key = started["session_id"], started["api_key"]
        self.inference_url = started.get("inference_url")

    @classmethod
    def start(
        cls, url: str, admin_key: str, task_id: str, group_size: int | None = None, wait_s: float = 0.0
    ) -> Session:
        body: dict[str, Any] = {"task_id": task_id, "wait_s": wait_s}
        if group_size is not None:
            body["group_size"] = group_size
        started = _call("POST", f"{url.rstrip('/')}/rl/start_session", admin_key, json=body, timeout=wait_s + 60)
        return cls(url, admin_key, started, task_id)

    def refresh(self, task_id: str | None = None, wait_s: float = 0.0) -> Session:
        """End this episode (exported) and start the next under the same key."""
        self.task_id = task_id or self.task_id
        body = {"task_id": self.task_id, "api_key": self.api_key, "wait_s": wait_s}
        started = _call("POST", f"{self.url}/rl/start_session", self.admin_key, json=body, timeout=wait_s + 180)
        self.session_id, self.inference_url = started["session_id"], started.get("inference_url")
        return self

    def openai_client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key, **kwargs)

    def set_reward(self, reward: float, interaction_id: str | None = None) -> dict:
        body: dict[str, Any] = {"reward": reward}
        if interaction_id is not None:
            body["interaction_id"] = interaction_id
        return _call("POST", f"{self.url}/rl/set_reward", self.api_key, json=body)

    def end(self, failed: bool = False) -> dict:
        return _call("POST", f"{self.url}/rl/end_session", self.api_key, json={"failed": failed})

    def __enter__(self) -> Session:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.end(failed=error is not None)
