"""RL jobs: the HTTP schema of ``/api/rl/jobs`` and the pure logic behind it.

A job is an RL config (synth-ai's payload or our own) that the JobManager
runs as a Ray job (``train_driver.py``). Here, without Ray: the request and
record models, turning a request into a validated :class:`RLGateConfig`,
Ray's job status in our words, and the events and progress read off the
run's ``metrics.jsonl``. Whether the cluster could ever hold a job is
:mod:`rlgate.training.placement`'s.

Status moves ``queued`` → ``running`` → ``succeeded`` | ``failed`` |
``cancelled``; events are ``rl.created``, ``rl.running``,
``rl.iteration.complete``, ``rl.evaluation.complete`` and one of
``rl.succeeded`` / ``rl.failed`` / ``rl.cancelled``.
"""

from __future__ import annotations

import tomllib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlgate.config import ConfigError, RLGateConfig, null_paths, parse_config_noting
from rlgate.jobs.synth import from_synth, is_synth_shape

Status = Literal["queued", "running", "succeeded", "failed", "cancelled"]
FINISHED = ("succeeded", "failed", "cancelled")

# Ray's JobStatus values, in our words.
RAY_STATUS = {
    "PENDING": "queued",
    "RUNNING": "running",
    "SUCCEEDED": "succeeded",
    "FAILED": "failed",
    "STOPPED": "cancelled",
}


class JobData(BaseModel):
    """synth-ai's ``data``: the task app, the parsed RL TOML and the model."""

    model_config = ConfigDict(extra="allow")
    endpoint_base_url: str | None = Field(None, description="The task app's base URL ([services] task_url).")
    config: dict[str, Any] | None = Field(None, description="The RL config as parsed TOML (synth-ai's or ours).")
    model: str | None = Field(None, description="Overrides [model] name (e.g. Qwen/Qwen3-0.6B from the local cache).")
    base_model: str | None = Field(None, description="The same as model (synth-ai's older name).")


class JobRequest(BaseModel):
    """``POST /api/rl/jobs``: synth-ai's shape (``job_type``, ``compute``, ``data``)
    or the native one (``config_toml`` as text, or ``config`` as JSON)."""

    model_config = ConfigDict(extra="forbid")
    job_type: Literal["rl"] = "rl"
    compute: dict[str, Any] = Field(default_factory=dict, description="synth-ai's [compute]: gpu_type, gpu_count.")
    data: JobData | None = None
    config: dict[str, Any] | None = Field(None, description="Native: the config as JSON.")
    config_toml: str | None = Field(None, description="Native: the config as TOML text.")
    task_app_url: str | None = Field(None, description="Native: overrides [services] task_url.")
    task_app_api_key: str | None = Field(
        None, description="The task app's environment key (sent as X-API-Key); kept out of the job's records."
    )
    tags: dict[str, Any] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)


class JobCreated(BaseModel):
    job_id: str
    status: Status
    api_key: str | None = Field(None, description="A key for this job's routes only; returned once, at creation.")


class Checkpoint(BaseModel):
    step: int
    path: str


class JobResults(BaseModel):
    final_reward: float | None = None
    checkpoints: list[Checkpoint] = Field(default_factory=list)
    model_path: str | None = Field(None, description="The final model: a Hugging Face folder.")


class Job(BaseModel):
    """What ``GET /api/rl/jobs/{id}`` answers (and what is kept on disk, with the key's hash)."""

    job_id: str
    status: Status
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    waiting: str | None = Field(
        None,
        description="Why a queued or running job has not started yet: the jobs ahead of it, or the resources "
        "it waits for and who holds them.",
    )
    progress: dict[str, Any] = Field(default_factory=dict)
    results: JobResults = Field(default_factory=JobResults)
    tags: dict[str, Any] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    model: str = ""
    task_app_url: str | None = None
    total_steps: int = 0


class Event(BaseModel):
    seq: int
    type: str
    message: str
    created_at: float
    data: dict[str, Any] = Field(default_factory=dict)


def job_config(request: JobRequest) -> RLGateConfig:
    """The request's validated config; ConfigError names every field that is wrong."""
    return job_plan(request)[0]


def job_plan(request: JobRequest) -> tuple[RLGateConfig, list[str]]:
    """The request's validated config and the synth-ai keys it carries that change
    nothing here ("section.key: why"); ConfigError names every field that is wrong."""
    try:
        config, ignored = _job_config(request)
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError, ArithmeticError, LookupError) as err:  # a value of the wrong
        # type where a table was due, a number past what it counts
        raise ConfigError(f"config: a value it cannot take: {err}") from None
    if nulls := null_paths(config.model_dump(mode="json", exclude_none=True)):  # the job's config is TOML on disk
        raise ConfigError(f"config: {', '.join(nulls[:5])}: null, which a config cannot hold; leave the key out")
    return config, ignored


def _job_config(request: JobRequest) -> tuple[RLGateConfig, list[str]]:
    given = [name for name in ("data", "config", "config_toml") if getattr(request, name) is not None]
    if len(given) != 1:
        raise ConfigError(
            "give the config exactly once: synth-ai's data.config, or config (JSON), or config_toml (text)"
            + (f"; got {', '.join(given)}" if given else "")
        )
    data = request.data or JobData()
    if request.config_toml is not None:
        try:
            raw = tomllib.loads(request.config_toml)
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config_toml: not valid TOML: {err}") from None
    else:
        raw = request.config if request.config is not None else (data.config or {})
    raw = {section: dict(body) if isinstance(body, dict) else body for section, body in raw.items()}
    task_url = data.endpoint_base_url or request.task_app_url
    if task_url:  # validated with the rest: [services] task_url in either shape
        raw["services"] = {**raw.get("services", {}), "task_url": task_url}
    if request.compute:  # synth-ai sends [compute] beside the config; it wins over the config's own
        if is_synth_shape(raw):
            raw["compute"] = {**raw.get("compute", {}), **request.compute}
        else:  # our own config: gpu_type / gpu_count become replicas, workers and GPUs as synth-ai's would
            for section, values in from_synth({"compute": request.compute}, "compute").items():
                raw[section] = {**raw.get(section, {}), **values}
    source = "data.config" if request.data is not None else "config"
    config, ignored = parse_config_noting(raw, source=source)
    model = data.model or data.base_model
    if model:
        config.model.name = model
    if config.task.reward is not None or config.task.dataset is not None:  # code and files of the cluster's
        raise ConfigError(
            f"{source}: task.dataset / task.reward: a job over HTTP cannot name files or code for the cluster "
            "to read and import; serve the dataset and its reward from a task app (rlgate.sdk.taskapp), "
            "or train it with `rlgate train` or `ray job submit`"
        )
    if config.logging.wandb:  # it would log in with the cluster's WANDB_API_KEY and send the run's text out
        raise ConfigError(
            f"{source}: logging.wandb: a job over HTTP cannot log to W&B with the cluster's credentials; "
            "use [logging] tensorboard (the files stay in the job's folder)"
        )
    if config.logging.mlflow:  # the cluster's MLFLOW_TRACKING_URI and credentials, or a server the job names
        raise ConfigError(
            f"{source}: logging.mlflow: a job over HTTP cannot log to MLflow with the cluster's tracking server "
            "and credentials; use [logging] tensorboard (the files stay in the job's folder)"
        )
    if config.services.task_url is None and config.task.builtin is None:
        raise ConfigError(
            f"{source}: a job needs episodes: set [services] task_url (or data.endpoint_base_url) or [task] builtin"
        )
    return config, ignored


def progress(metrics: list[dict], total_steps: int) -> dict[str, Any]:
    """The job's progress from its metrics lines so far."""
    if not metrics:
        return {"step": 0, "total_steps": total_steps, "fraction": 0.0}
    last = metrics[-1]
    return {
        "step": last["step"],
        "total_steps": total_steps,
        "fraction": last["step"] / total_steps,
        "reward_mean": last.get("reward_mean"),
        "policy_version": last.get("version"),
        "failed_episodes": last.get("failed", 0),
    }


def step_events(metrics: dict) -> list[tuple[str, str, dict]]:
    """The events one metrics line makes, as (type, message, data)."""
    step = metrics["step"]
    return [("rl.iteration.complete", f"step {step}: reward {metrics.get('reward_mean', float('nan')):.3f}", metrics)]


def evaluation_event(line: dict) -> tuple[str, str, dict]:
    """The event of one evaluation (a line of the run's ``eval.jsonl``), as (type, message, data)."""
    mean = line.get("eval_reward_mean")
    result = f"reward {mean:.3f}" if mean is not None else "every episode failed"
    summary = {k: v for k, v in line.items() if k == "step" or k.startswith("eval_")}
    return "rl.evaluation.complete", f"evaluation after step {line['step']}: {result}", summary
