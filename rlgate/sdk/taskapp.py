"""Task apps: the synth-ai contract, a helper to write one, and the client rlgate uses.

A task app is an HTTP service that runs an environment and scores episodes:

* ``GET /health``: 200 when ready.
* ``GET /task_info``: what the task is (:class:`TaskInfo`).
* ``POST /rollout``: play one episode (:class:`RolloutRequest` → :class:`RolloutResponse`).
  The request's ``policy.config.inference_url`` is an OpenAI base URL scoped to
  one gateway session; the app calls the policy there, as often as the episode
  needs, and answers with ``metrics.outcome_reward``.

Every route takes the environment key in ``X-API-Key`` when the app has one
(``ENVIRONMENT_API_KEY``, as in synth-ai). The models are lenient where task
apps in the wild differ (unknown fields are kept, optional ones default), so
apps written for synth-ai work unchanged.

Write one in a few lines with :func:`create_task_app`::

    async def rollout(episode: Episode) -> float:
        reply = await episode.chat([{"role": "user", "content": "What is 2 + 2?"}])
        return float(reply.strip() == "4")

    app = create_task_app("add", rollout)
    serve(app, port=8201)                     # or: uvicorn module:app
"""

from __future__ import annotations

import hmac
import logging
import os
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

if TYPE_CHECKING:
    from rlgate.jobs.egress import Allowlist

API_KEY_ENV = "ENVIRONMENT_API_KEY"
logger = logging.getLogger(__name__)


def environment_key() -> str | None:
    """The task app's key: ``$ENVIRONMENT_API_KEY``, or the file ``$ENVIRONMENT_API_KEY_FILE`` names."""
    if os.environ.get(API_KEY_ENV):
        return os.environ[API_KEY_ENV]
    path = os.environ.get(f"{API_KEY_ENV}_FILE")
    if not path:
        return None
    try:
        with open(path) as file:
            return file.read().strip()
    except (OSError, UnicodeDecodeError) as err:
        why = err.strerror if isinstance(err, OSError) else "not text"
        raise KeyFileError(f"${API_KEY_ENV}_FILE names {path}, which cannot be read ({why})") from None


class KeyFileError(ValueError):
    """``$ENVIRONMENT_API_KEY_FILE`` names a file that cannot be read."""


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class EnvSpec(_Open):
    env_id: str | None = None
    env_name: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    seed: int | None = None


class PolicySpec(_Open):
    policy_id: str | None = None
    policy_name: str | None = None
    config: dict[str, Any] = Field(default_factory=dict, description="model, inference_url, sampling settings")


class RolloutRequest(_Open):
    run_id: str
    env: EnvSpec
    policy: PolicySpec
    ops: list[Any] = Field(default_factory=list)
    record: dict[str, Any] = Field(default_factory=dict)
    on_done: str = "reset"
    safety: dict[str, Any] = Field(default_factory=dict)
    mode: Literal["rl", "eval"] = "rl"
    training_session_id: str | None = None


class RolloutMetrics(_Open):
    episode_returns: list[float] = Field(default_factory=list)
    mean_return: float | None = None
    num_steps: int = 0
    num_episodes: int = 1
    outcome_reward: float | None = None
    outcome_score: float | None = None  # older synth-ai name for the outcome reward
    event_rewards: list[float] | None = None
    details: dict[str, Any] = Field(default_factory=dict)

    def reward(self) -> float | None:
        """The episode's outcome reward, under whichever name the app used."""
        for value in (self.outcome_reward, self.outcome_score, self.mean_return):
            if value is not None:
                return float(value)
        return None


class RolloutResponse(_Open):
    run_id: str
    trajectories: list[dict[str, Any]] = Field(default_factory=list)
    metrics: RolloutMetrics
    aborted: bool = False
    ops_executed: int = 0


class TaskInfo(_Open):
    task: dict[str, Any] = Field(default_factory=dict)
    environments: list[str] = Field(default_factory=list)
    action_space: dict[str, Any] = Field(default_factory=dict)
    observation: dict[str, Any] = Field(default_factory=dict)
    dataset: dict[str, Any] = Field(default_factory=dict)
    rubric: dict[str, Any] = Field(default_factory=dict)
    inference: dict[str, Any] = Field(default_factory=dict)
    capabilities: dict[str, Any] = Field(default_factory=dict)
    limits: dict[str, Any] = Field(default_factory=dict)


# --- writing a task app ----------------------------------------------------------


@dataclass
class Outcome:
    """What a rollout function may return instead of a bare reward."""

    reward: float
    event_rewards: list[float] | None = None
    steps: int = 1
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Episode:
    """One rollout as the app's function sees it: the seed and config it was asked
    for, and the policy behind ``client`` (an ``openai.AsyncOpenAI``)."""

    request: RolloutRequest
    client: Any
    model: str

    @property
    def seed(self) -> int:
        return self.request.env.seed or 0

    @property
    def config(self) -> dict[str, Any]:
        return self.request.env.config

    async def chat(self, messages: list[dict], **kwargs) -> str:
        """One policy turn: the reply's text (the full response: ``client.chat.completions.create``)."""
        reply = await self.client.chat.completions.create(
            model=self.model, messages=messages, **(sampling(self.request.policy.config) | kwargs)
        )
        return reply.choices[0].message.content or ""


_SAMPLING = {"temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "seed"}


def sampling(policy_config: dict[str, Any]) -> dict[str, Any]:
    """The chat request's sampling settings in a rollout's ``policy.config``: OpenAI's own,
    synth-ai's ``stop_sequences`` as ``stop``, and ``top_k`` (vLLM's) in the body."""
    settings = {k: v for k, v in policy_config.items() if k in _SAMPLING}
    if policy_config.get("stop_sequences") and "stop" not in settings:
        settings["stop"] = policy_config["stop_sequences"]
    if policy_config.get("top_k") is not None:
        settings["extra_body"] = {"top_k": policy_config["top_k"]}
    return settings


def create_task_app(
    name: str,
    rollout: Callable[[Episode], Awaitable[float | Outcome]],
    *,
    description: str = "",
    dataset: dict[str, Any] | None = None,
    api_key: str | None = None,
):
    """A FastAPI app serving ``/health``, ``/task_info`` and ``/rollout`` around
    ``rollout``. ``api_key`` (default: ``$ENVIRONMENT_API_KEY``, or the file
    ``$ENVIRONMENT_API_KEY_FILE`` names) is required in ``X-API-Key`` on every
    route when set; ``api_key=""`` opens the app to anyone who can reach it, and
    an empty key file is refused (it would do the same unasked). A rollout
    function that raises answers 500 with the error: the trainer counts that
    episode as failed."""
    import openai
    from fastapi import FastAPI, Header, HTTPException

    key = api_key if api_key is not None else environment_key()
    if api_key is None and key is not None and not key.strip():
        raise ValueError(
            f"the task app's key file (${API_KEY_ENV}_FILE) is empty: write the key in it, "
            'or pass api_key="" for an app open to anyone who can reach it'
        )
    app = FastAPI(title=f"{name} task app", description=description)
    info = TaskInfo(
        task={"name": name, "description": description},
        environments=[name],
        dataset=dataset or {},
        inference={"providers": ["openai-compatible"]},
        capabilities={"rollout": True, "modes": ["rl", "eval"]},
    )

    def check(x_api_key: str | None) -> None:
        if key and not (x_api_key and hmac.compare_digest(x_api_key.encode(), key.encode())):
            raise HTTPException(401, "missing or wrong X-API-Key (the environment key)")

    @app.get("/health")
    async def health(x_api_key: str | None = Header(None)):
        check(x_api_key)
        return {"healthy": True, "name": name}

    @app.get("/task_info", response_model=TaskInfo)
    async def task_info(x_api_key: str | None = Header(None)):
        check(x_api_key)
        return info

    @app.post("/rollout", response_model=RolloutResponse)
    async def do_rollout(request: RolloutRequest, x_api_key: str | None = Header(None)):
        check(x_api_key)
        policy = request.policy.config
        if not policy.get("inference_url"):
            raise HTTPException(422, "policy.config.inference_url is required: the policy's OpenAI base URL")
        client = openai.AsyncOpenAI(base_url=policy["inference_url"], api_key=policy.get("api_key") or "unused")
        try:
            result = await rollout(Episode(request, client, policy.get("model") or "default"))
        except Exception as err:  # the environment's own failure: the trainer counts the episode as failed
            logger.exception("rollout %s failed", request.run_id)  # here: the trainer reports only the 500
            raise HTTPException(500, f"rollout failed: {err.__class__.__name__}: {err}") from None
        finally:
            await client.close()
        outcome = result if isinstance(result, Outcome) else Outcome(float(result))
        metrics = RolloutMetrics(
            episode_returns=[outcome.reward],
            mean_return=outcome.reward,
            num_steps=outcome.steps,
            outcome_reward=outcome.reward,
            event_rewards=outcome.event_rewards,
            details=outcome.details,
        )
        return RolloutResponse(run_id=request.run_id, metrics=metrics, ops_executed=outcome.steps)

    return app


def serve(app, port: int, description: str = "a task app") -> None:
    """Run ``app`` with uvicorn; ``--host`` and ``--port`` on the command line override."""
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=port)
    args = parser.parse_args()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


# --- calling a task app ----------------------------------------------------------


class TaskAppError(Exception):
    """A task app check or rollout that failed; the message says which and why."""


class TaskAppClient:
    """The trainer's side of the contract, over ``httpx.AsyncClient``.

    With ``allowed`` (a run's driver passes ``[jobs] task_app_hosts``), every
    connection is checked against it as it is made (:mod:`rlgate.jobs.egress`).
    Errors never quote what the app answered, only its status, content type
    and length: a job's error is readable with the job's own key, and a URL
    pointing at an internal service must not turn its answers into text."""

    def __init__(
        self, base_url: str, api_key: str | None = None, timeout_s: float = 600.0, allowed: Allowlist | None = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key, self.timeout_s, self.allowed = api_key, timeout_s, allowed
        self.headers = {"X-API-Key": api_key} if api_key else {}
        self._http = None  # made on first use, in the event loop that uses it

    def copy(self) -> TaskAppClient:
        """The same app and settings, for use in another event loop."""
        return TaskAppClient(self.base_url, self.api_key, self.timeout_s, self.allowed)

    def _client(self, timeout_s: float):
        import httpx

        from rlgate.jobs.egress import GuardedTransport

        transport = GuardedTransport(self.allowed) if self.allowed is not None else None
        return httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=timeout_s, transport=transport)

    @property
    def http(self):
        if self._http is None:
            self._http = self._client(self.timeout_s)
        return self._http

    async def _get(self, path: str) -> dict:
        import httpx

        from rlgate.jobs.egress import TargetRefused

        where = f"GET {self.base_url}{path}"
        try:
            async with self._client(30) as http:
                answer = await http.get(path)
        except TargetRefused as err:
            raise TaskAppError(f"{where}: {err}") from None
        except httpx.HTTPError as err:
            raise TaskAppError(f"{where}: unreachable ({_transport_error(err)})") from None
        if answer.status_code in (401, 403) or _key_refused(answer):
            raise TaskAppError(
                f"{where}: {answer.status_code} unauthorised; set {API_KEY_ENV} to the task app's environment key"
                + (" (the task app needs one of its own too)" if answer.status_code == 503 else "")
            )
        if answer.status_code != 200:
            raise TaskAppError(f"{where}: {_status(answer)}")
        try:
            return answer.json()
        except ValueError:
            raise TaskAppError(f"{where}: the answer is not JSON ({_status(answer)})") from None

    async def check(self) -> TaskInfo:
        """``/health`` then ``/task_info``; TaskAppError names the check that failed."""
        await self._get("/health")
        try:
            return TaskInfo.model_validate(await self._get("/task_info"))
        except ValidationError as err:
            raise TaskAppError(f"GET {self.base_url}/task_info: not a TaskInfo: {_problems(err)}") from None

    async def rollout(self, request: RolloutRequest) -> RolloutResponse:
        import httpx

        from rlgate.jobs.egress import TargetRefused

        try:
            answer = await self.http.post("/rollout", json=request.model_dump(mode="json", exclude_none=True))
        except TargetRefused as err:
            raise TaskAppError(f"POST /rollout: {err}") from None
        except httpx.HTTPError as err:
            raise TaskAppError(f"POST /rollout: {_transport_error(err)}") from None
        if answer.status_code != 200:
            raise TaskAppError(f"POST /rollout: {_status(answer)}")
        try:
            return RolloutResponse.model_validate(answer.json())
        except ValidationError as err:
            raise TaskAppError(f"POST /rollout: not a RolloutResponse: {_problems(err)}") from None
        except ValueError:
            raise TaskAppError(f"POST /rollout: the answer is not JSON ({_status(answer)})") from None


def _status(answer) -> str:
    """An answer in a few words: status, reason, content type and length; never its body."""
    kind = answer.headers.get("content-type", "no content type").split(";")[0].strip()
    kind = kind if re.fullmatch(r"[\w.+-]{1,64}/[\w.+-]{1,64}", kind) else "unknown content type"
    said = f"{answer.status_code} {answer.reason_phrase}".rstrip() + f" ({kind}, {len(answer.content)} bytes)"
    return said + ("; redirects are not followed: give the final URL" if answer.is_redirect else "")


def _problems(err: ValidationError) -> str:
    """What is wrong with a shape, by place; without the values (they came from the app)."""
    errors = err.errors(include_url=False, include_input=False, include_context=False)
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'the answer'}: {e['msg']}" for e in errors[:5])


def _transport_error(err) -> str:
    """A failed exchange in words of our own: a protocol error may quote bytes the other end sent."""
    import httpx

    if isinstance(err, httpx.ProtocolError | httpx.DecodingError):
        return f"{err.__class__.__name__}: the answer is not HTTP that rlgate reads"
    return f"{err.__class__.__name__}: {err}"


def _key_refused(answer) -> bool:
    """synth-ai's task apps refuse a wrong key with 400 ("unauthorised") and answer 503
    when they have no key of their own, not 401/403."""
    if answer.status_code not in (400, 503):
        return False
    text = answer.text[:2000].lower()
    return any(word in text for word in ("unauthori", "api key", "api_key", "environment_api_key"))
