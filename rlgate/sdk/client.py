"""The Python SDK: RL jobs (as synth-ai's ``RLJob``) and sessions (as AReaL's flow).

    client = Client()                      # $RLGATE_URL (default http://127.0.0.1:8000), $RLGATE_ADMIN_KEY
    job = RLJob.from_config("configs/taskapp-math.toml", client=client, task_app_url="http://127.0.0.1:8201")
    job.submit()
    final = job.poll_until_complete(timeout=3600, on_status=print)
    print(job.get_results()["final_reward"])

    with Session.start(task_id="math-17", client=client) as session:
        reply = session.openai_client().chat.completions.create(model="default", messages=[...])
        session.set_reward(1.0)

:class:`AsyncClient`, :class:`AsyncRLJob` and :class:`AsyncSession` are the
same API with ``await``. A client keeps one pooled HTTP connection set
(``httpx``) for everything made from it. Connections that could not be
opened and 429 answers (no capacity: nothing was done) are retried
``max_retries`` times, after the server's ``Retry-After`` or an exponential
backoff; so are 503 answers to calls that may safely be made twice (GETs, a
job submission, which carries an ``Idempotency-Key``, and the session calls),
but not to others, where a 503 may come after the work was done. A refusal
raises a typed :class:`APIStatusError` (``AuthenticationError``,
``NotFoundError``, ``RateLimitError``, ...) carrying the server's message;
an unreachable server :class:`APIConnectionError`. All are
:class:`RLGateError`, whose ``status`` is the HTTP status (0: unreachable).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import random
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"
FINISHED = ("succeeded", "failed", "cancelled")
REFUSED_UNDONE = 429  # no capacity: the server did nothing
MAX_RETRY_AFTER_S = 60.0


class RLGateError(Exception):
    """A refused or failed request: ``status`` is the HTTP status (0: the server was unreachable)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class APIConnectionError(RLGateError):
    """The server could not be reached (or the connection broke before an answer)."""

    def __init__(self, message: str) -> None:
        super().__init__(0, message)


class APIStatusError(RLGateError):
    """The server answered with an error status; ``message`` is what it said."""

    def __init__(self, status: int, message: str, response: httpx.Response | None = None) -> None:
        super().__init__(status, message)
        self.response = response


class BadRequestError(APIStatusError):  # 400
    pass


class AuthenticationError(APIStatusError):  # 401: no key, a wrong key
    pass


class PermissionDeniedError(APIStatusError):  # 403: a key for something else (another job)
    pass


class NotFoundError(APIStatusError):  # 404
    pass


class ConflictError(APIStatusError):  # 409: not in a state for this (a finished job, a session being ended)
    pass


class GoneError(APIStatusError):  # 410: the session has ended
    pass


class UnprocessableEntityError(APIStatusError):  # 422: the config or request says something wrong
    pass


class RateLimitError(APIStatusError):  # 429: no capacity now
    pass


class InternalServerError(APIStatusError):  # 5xx
    pass


_ERRORS = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    410: GoneError,
    422: UnprocessableEntityError,
    429: RateLimitError,
}


def _refusal(answer: httpx.Response) -> APIStatusError:
    try:
        message = answer.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = answer.text[:500]
    kind = _ERRORS.get(answer.status_code, InternalServerError if answer.status_code >= 500 else APIStatusError)
    return kind(answer.status_code, f"{answer.status_code}: {message}", answer)


def _wait_s(attempt: int, answer: httpx.Response | None) -> float:
    """How long to wait before retry ``attempt`` (0-based): the server's Retry-After, else 0.5 s doubling."""
    if answer is not None:
        try:
            return min(MAX_RETRY_AFTER_S, max(0.0, float(answer.headers["Retry-After"])))
        except (KeyError, ValueError):
            pass
    return min(8.0, 0.5 * 2**attempt) * random.uniform(0.75, 1.25)


def _then(answer, use: Callable[[Any], Any]):
    """``use(answer)``, or for an awaitable answer (an async client's) an awaitable of it."""
    if inspect.isawaitable(answer):

        async def later():
            return use(await answer)

        return later()
    return use(answer)


class _Call:
    """One call's method and URL, and what its retries may do: ``repeatable``, a 503
    is retried (the call does no harm made twice); ``done_status``, that answer to a
    retry means an earlier attempt did what was asked (410 to a repeated session end)."""

    def __init__(self, method: str, url: str, headers: dict, repeatable: bool | None, done_status: int | None):
        self.method, self.url, self.done_status = method, url, done_status
        self.maybe_done = False  # an attempt may have done it: answered 503, or its answer was lost
        if repeatable is None:
            repeatable = method in ("GET", "HEAD") or "Idempotency-Key" in headers
        self.repeatable = repeatable

    def __str__(self) -> str:
        return f"{self.method} {self.url}"


class _Settings:
    def __init__(self, base_url: str | None, api_key: str | None, timeout: float, max_retries: int) -> None:
        self.base_url = (base_url or os.environ.get("RLGATE_URL") or DEFAULT_URL).rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("RLGATE_ADMIN_KEY")
        self.timeout, self.max_retries = timeout, max_retries

    def _request(self, method: str, path: str, api_key: str | None, headers: dict | None, timeout: float | None):
        """The URL, the headers and the timeout of a call."""
        key = api_key if api_key is not None else self.api_key
        if key is None:
            raise AuthenticationError(401, "no API key given: pass api_key or set RLGATE_ADMIN_KEY")
        headers = {"Authorization": f"Bearer {key}", **(headers or {})}
        return f"{self.base_url}{path}", headers, self.timeout if timeout is None else timeout

    def _outcome(self, call: _Call, attempt: int, answer=None, error: Exception | None = None):
        """The answer's JSON, an error to raise, or (None, wait) to try again."""
        if error is not None:
            if isinstance(error, httpx.InvalidURL | httpx.UnsupportedProtocol):
                return RLGateError(0, f"{call}: not a URL this client can call ({error})"), None
            # A connection never opened: the request was not sent. Any other broken exchange (a
            # connection the server closed, a read cut short) only where the call may be made twice.
            unsent = isinstance(error, httpx.ConnectError | httpx.ConnectTimeout)
            if (unsent or (call.repeatable and isinstance(error, httpx.TransportError))) and attempt < self.max_retries:
                call.maybe_done = call.maybe_done or not unsent
                return None, _wait_s(attempt, None)
            return APIConnectionError(f"{call}: unreachable ({error.__class__.__name__}: {error})"), None
        status = answer.status_code
        if attempt < self.max_retries and (status == REFUSED_UNDONE or (status == 503 and call.repeatable)):
            call.maybe_done = call.maybe_done or status == 503
            return None, _wait_s(attempt, answer)
        if call.maybe_done and status == call.done_status:
            return {"message": f"{_refusal(answer).message} (retried: an earlier attempt most likely did it)"}, None
        if status >= 400:
            return _refusal(answer), None
        try:
            return answer.json(), None
        except ValueError:
            return APIStatusError(status, f"{call}: {status} but not JSON: {answer.text[:200]!r}", answer), None


class Client(_Settings):
    """A gateway's HTTP API, over one pooled ``httpx.Client``.

    ``base_url`` defaults to ``$RLGATE_URL`` (else http://127.0.0.1:8000) and
    ``api_key`` to ``$RLGATE_ADMIN_KEY``; a call may pass another key (a
    session's, a job's)."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 60.0,
        max_retries: int = 2,
        http_client: httpx.Client | None = None,
    ) -> None:
        super().__init__(base_url, api_key, timeout, max_retries)
        self.http = http_client or httpx.Client()

    def request(
        self,
        method: str,
        path: str,
        *,
        api_key: str | None = None,
        headers: dict | None = None,
        timeout: float | None = None,
        repeatable: bool | None = None,
        done_status: int | None = None,
        **kwargs,
    ) -> Any:
        url, headers, timeout = self._request(method, path, api_key, headers, timeout)
        call = _Call(method, url, headers, repeatable, done_status)
        attempt = 0
        while True:
            try:
                answer = self.http.request(method, url, headers=headers, timeout=timeout, **kwargs)
                outcome, wait = self._outcome(call, attempt, answer=answer)
            except (httpx.HTTPError, httpx.InvalidURL) as err:
                outcome, wait = self._outcome(call, attempt, error=err)
            if wait is None:
                if isinstance(outcome, RLGateError):
                    raise outcome
                return outcome
            time.sleep(wait)
            attempt += 1

    def list_jobs(self) -> list[dict]:
        """Every job on the gateway, newest first (the admin key)."""
        return self.request("GET", "/api/rl/jobs")

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(_Settings):
    """:class:`Client` with ``await``, over one pooled ``httpx.AsyncClient``."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 60.0,
        max_retries: int = 2,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        super().__init__(base_url, api_key, timeout, max_retries)
        self.http = http_client or httpx.AsyncClient()

    async def request(
        self,
        method: str,
        path: str,
        *,
        api_key: str | None = None,
        headers: dict | None = None,
        timeout: float | None = None,
        repeatable: bool | None = None,
        done_status: int | None = None,
        **kwargs,
    ) -> Any:
        url, headers, timeout = self._request(method, path, api_key, headers, timeout)
        call = _Call(method, url, headers, repeatable, done_status)
        attempt = 0
        while True:
            try:
                answer = await self.http.request(method, url, headers=headers, timeout=timeout, **kwargs)
                outcome, wait = self._outcome(call, attempt, answer=answer)
            except (httpx.HTTPError, httpx.InvalidURL) as err:
                outcome, wait = self._outcome(call, attempt, error=err)
            if wait is None:
                if isinstance(outcome, RLGateError):
                    raise outcome
                return outcome
            await asyncio.sleep(wait)
            attempt += 1

    async def list_jobs(self) -> list[dict]:
        return await self.request("GET", "/api/rl/jobs")

    async def close(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def list_jobs(backend_url: str | None = None, api_key: str | None = None) -> list[dict]:
    """Every job on the gateway, newest first (the admin key)."""
    with Client(backend_url, api_key) as client:
        return client.list_jobs()


def job_payload(
    config_path: str | Path,
    task_app_url: str | None = None,
    model: str | None = None,
    overrides: dict | None = None,
    task_app_api_key: str | None = None,
) -> dict:
    """The job body for the TOML at ``config_path`` (synth-ai's shape or ours), in synth-ai's payload shape."""
    from rlgate.config import ConfigError, read_toml

    path = Path(config_path)
    try:
        config = read_toml(path)
    except ConfigError as err:
        raise RLGateError(0, str(err)) from None
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
    return payload


class _Job:
    """The requests of one RL job (``/api/rl/jobs``); with an :class:`AsyncClient`
    each method returns an awaitable."""

    _client_class: type = Client

    def __init__(
        self,
        backend_url: str | None = None,
        api_key: str | None = None,
        payload: dict | None = None,
        idempotency_key: str | None = None,
        job_id: str | None = None,
        client: Client | AsyncClient | None = None,
    ) -> None:
        self.client = client or self._client_class(backend_url, api_key)
        self.backend_url, self.api_key = self.client.base_url, api_key
        self.payload, self.idempotency_key, self.job_id = payload, idempotency_key, job_id
        self.job_api_key: str | None = None  # this job's own key, returned by submit()

    @classmethod
    def from_config(
        cls,
        config_path: str | Path,
        backend_url: str | None = None,
        api_key: str | None = None,
        task_app_url: str | None = None,
        idempotency_key: str | None = None,
        model: str | None = None,
        overrides: dict | None = None,
        task_app_api_key: str | None = None,
        client: Client | AsyncClient | None = None,
    ):
        """A job for the TOML at ``config_path``; ``task_app_url`` overrides ``[services] task_url``;
        ``task_app_api_key`` is the task app's environment key (kept out of the job's records)."""
        payload = job_payload(config_path, task_app_url, model, overrides, task_app_api_key)
        return cls(backend_url, api_key, payload, idempotency_key, client=client)

    @classmethod
    def from_job_id(
        cls,
        job_id: str,
        backend_url: str | None = None,
        api_key: str | None = None,
        client: Client | AsyncClient | None = None,
    ):
        return cls(backend_url, api_key, job_id=job_id, client=client)

    def _call(self, method: str, suffix: str = "", **kwargs):
        if self.job_id is None:
            raise RLGateError(0, "this job is not submitted yet; call submit() first")
        return self.client.request(method, f"/api/rl/jobs/{self.job_id}{suffix}", api_key=self.api_key, **kwargs)

    def submit(self):
        """Create the job; with an idempotency key a resubmission returns the same job. Returns its id.
        Without one, this call's retries carry a key of their own: a retry never makes a second job."""
        if self.payload is None:
            raise RLGateError(0, "nothing to submit: this job was made from an id")
        headers = {"Idempotency-Key": self.idempotency_key or f"rlgate-sdk-{uuid.uuid4().hex}"}
        answer = self.client.request("POST", "/api/rl/jobs", api_key=self.api_key, json=self.payload, headers=headers)
        return _then(answer, self._submitted)

    def _submitted(self, created: dict) -> str:
        self.job_id, self.job_api_key = created["job_id"], created.get("api_key")
        return self.job_id

    def get_status(self):
        return self._call("GET")

    def events(self, since_seq: int = 0, limit: int = 200):
        return self._call("GET", "/events", params={"since_seq": since_seq, "limit": limit})

    def metrics(self, after_step: int = 0):
        return _then(self._call("GET", "/metrics", params={"after_step": after_step}), lambda a: a["points"])

    def cancel(self):
        return self._call("POST", "/cancel")

    def get_results(self):
        """``final_reward``, ``checkpoints`` ([{step, path}]) and ``model_path`` of a finished job."""
        return _then(self.get_status(), lambda status: status["results"])

    def _finished(self, status: dict, deadline: float, timeout: float, on_status) -> bool:
        if on_status is not None:
            on_status(status)
        if status["status"] in FINISHED:
            return True
        if time.monotonic() >= deadline:
            raise TimeoutError(f"job {self.job_id} still {status['status']} after {timeout:g} s")
        return False


class RLJob(_Job):
    """One RL job on an rlgate gateway (``/api/rl/jobs``)."""

    def poll_until_complete(
        self, timeout: float = 3600.0, interval: float = 5.0, on_status: Callable[[dict], None] | None = None
    ) -> dict:
        """Poll until the job has finished (any of succeeded, failed, cancelled); its last status.
        TimeoutError after ``timeout`` seconds (the job keeps running)."""
        deadline = time.monotonic() + timeout
        while not self._finished(status := self.get_status(), deadline, timeout, on_status):
            time.sleep(interval)
        return status


class AsyncRLJob(_Job):
    """:class:`RLJob` with ``await``."""

    _client_class = AsyncClient

    async def poll_until_complete(
        self, timeout: float = 3600.0, interval: float = 5.0, on_status: Callable[[dict], None] | None = None
    ) -> dict:
        deadline = time.monotonic() + timeout
        while not self._finished(status := await self.get_status(), deadline, timeout, on_status):
            await asyncio.sleep(interval)
        return status


class _Session:
    """The requests of one gateway session; with an :class:`AsyncClient` each
    method returns an awaitable."""

    _client_class: type = Client

    def __init__(self, client: Client | AsyncClient, started: dict, task_id: str) -> None:
        self.client, self.task_id = client, task_id
        self.url = client.base_url
        self.session_id, self.api_key = started["session_id"], started["api_key"]
        self.inference_url = started.get("inference_url")

    @classmethod
    def start(
        cls,
        url: str | None = None,
        admin_key: str | None = None,
        task_id: str = "default",
        group_size: int | None = None,
        wait_s: float = 0.0,
        client: Client | AsyncClient | None = None,
    ):
        """Start a session (the admin key); ``wait_s``: wait that long for capacity instead of a 429."""
        client = client or cls._client_class(url, admin_key)
        body: dict[str, Any] = {"task_id": task_id, "wait_s": wait_s}
        if group_size is not None:
            body["group_size"] = group_size
        # repeatable: a start whose answer was lost leaves at worst an idle session the gateway ends
        started = client.request(
            "POST", "/rl/start_session", api_key=admin_key, json=body, timeout=wait_s + 60, repeatable=True
        )
        return _then(started, lambda answer: cls(client, answer, task_id))

    @classmethod
    def of_key(cls, api_key: str, url: str | None = None, client: Client | AsyncClient | None = None):
        """A session already started, known by its key (for ``set_reward`` and ``end``)."""
        return cls(client or cls._client_class(url), {"session_id": None, "api_key": api_key}, "")

    def refresh(self, task_id: str | None = None, wait_s: float = 0.0, admin_key: str | None = None):
        """End this episode (exported) and start the next under the same key (the admin key)."""
        self.task_id = task_id or self.task_id
        body = {"task_id": self.task_id, "api_key": self.api_key, "wait_s": wait_s}
        started = self.client.request("POST", "/rl/start_session", api_key=admin_key, json=body, timeout=wait_s + 180)
        return _then(started, self._refreshed)

    def _refreshed(self, started: dict):
        self.session_id, self.inference_url = started["session_id"], started.get("inference_url")
        return self

    def set_reward(self, reward: float, interaction_id: str | None = None, turn_rewards: list[float] | None = None):
        """Reward the session's latest completion (or ``interaction_id``'s); ``turn_rewards``:
        one reward per turn instead, in order."""
        body: dict[str, Any] = {"reward": reward}
        if interaction_id is not None:
            body["interaction_id"] = interaction_id
        if turn_rewards is not None:
            body["turn_rewards"] = turn_rewards
        return self.client.request("POST", "/rl/set_reward", api_key=self.api_key, json=body, repeatable=True)

    def end(self, failed: bool = False):
        """End the session (saved for training). Retried after a 503; a retry answered 410
        (ended) counts as done: the attempt that got the 503 had ended it."""
        body = {"failed": failed}
        return self.client.request(
            "POST", "/rl/end_session", api_key=self.api_key, json=body, repeatable=True, done_status=410
        )


class Session(_Session):
    """One gateway session: start it, point an OpenAI client at it, reward it, end it.
    As a context manager it ends the session on exit (as failed if the block raised)."""

    def openai_client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key, **kwargs)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.end(failed=error is not None)


class AsyncSession(_Session):
    """:class:`Session` with ``await``; ``async with`` ends it on exit."""

    _client_class = AsyncClient

    def openai_client(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key, **kwargs)

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, kind, error, traceback) -> None:
        await self.end(failed=error is not None)
