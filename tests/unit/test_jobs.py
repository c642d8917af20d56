"""rlgate.jobs.schema: job requests to configs, progress and events (pure)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rlgate.config import ConfigError
from rlgate.jobs import schema as jobs

SYNTH = {
    "algorithm": {"type": "online", "method": "policy_gradient", "variety": "gspo"},
    "model": {"base": "smollm2-135m-instruct", "trainer_mode": "full"},
    "rollout": {"env_name": "math", "max_concurrent_rollouts": 4},
    "training": {"batch_size": 2, "group_size": 4, "learning_rate": 1e-5, "iterations_per_epoch": 3},  # 2 groups
}


def test_synth_ai_payload_maps_onto_a_config():
    request = jobs.JobRequest.model_validate(
        {
            "job_type": "rl",
            "compute": {"gpu_type": "cpu", "gpu_count": 0},
            "data": {"endpoint_base_url": "http://127.0.0.1:8201", "config": SYNTH, "model": "tiny-random"},
            "tags": {"team": "a"},
        }
    )
    config = jobs.job_config(request)
    assert config.services.task_url == "http://127.0.0.1:8201"
    assert config.model.name == "tiny-random"  # data.model wins over [model] base
    assert config.algorithm.variety == "gspo" and config.training.total_steps == 3
    assert config.compute.gpus_per_worker == 0  # gpu_type "cpu"
    assert config.task.env_name == "math" and config.task.max_concurrent == 4


def test_synth_compute_beside_a_native_config_maps_to_workers_and_gpus():
    native = {"model": {"name": "tiny-random"}, "task": {"builtin": "vowels"}}
    cpu = jobs.job_config(jobs.JobRequest(config=native, compute={"gpu_type": "cpu", "gpu_count": 0}))
    assert cpu.compute.gpus_per_worker == 0
    gpus = jobs.job_config(jobs.JobRequest(config=native, compute={"gpu_type": "H100", "gpu_count": 4}))
    assert (gpus.rollout.num_gpus, gpus.compute.trainer_workers, gpus.compute.gpus_per_worker) == (1, 3, 1)
    with pytest.raises(ConfigError, match="compute.gpu_kind: unknown key"):
        jobs.job_config(jobs.JobRequest(config=native, compute={"gpu_kind": "H100"}))


def test_native_payloads_toml_or_json():
    toml = '[model]\nname = "tiny-random"\n[task]\nbuiltin = "vowels"\n[training]\ntotal_steps = 2\n'
    config = jobs.job_config(jobs.JobRequest(config_toml=toml))
    assert (config.task.builtin, config.training.total_steps) == ("vowels", 2)
    config = jobs.job_config(
        jobs.JobRequest(config={"model": {"name": "tiny-random"}}, task_app_url="http://127.0.0.1:9")
    )
    assert config.services.task_url == "http://127.0.0.1:9"


@pytest.mark.parametrize(
    "body, message",
    [
        ({}, "give the config exactly once"),
        ({"config": {}, "config_toml": ""}, "got config, config_toml"),
        ({"config_toml": "[model"}, "config_toml: not valid TOML"),
        ({"config": {"model": {"name": "tiny-random"}}}, "a job needs episodes"),
        ({"config": {"training": {"batch_size": 0}, "task": {"builtin": "vowels"}}}, "training.batch_size"),
        ({"config": {"trainig": {}, "task": {"builtin": "vowels"}}}, "trainig: unknown key"),
        ({"data": {"config": {**SYNTH, "training": {"lora": True}}}}, "training.lora"),
        (  # a reward function is code the cluster would import for whoever submits
            {"config": {"task": {"dataset": "rows.jsonl", "reward": "os:system"}}},
            "task.dataset / task.reward: a job over HTTP cannot name files or code for the cluster",
        ),
        (
            {"config": {"task": {"builtin": "vowels"}, "logging": {"wandb": True}}},
            "logging.wandb: a job over HTTP cannot log to W&B with the cluster's credentials",
        ),
    ],
)
def test_bad_requests_name_what_is_wrong(body, message):
    with pytest.raises(ConfigError, match=message):
        jobs.job_config(jobs.JobRequest.model_validate(body))


def test_unknown_request_fields_are_refused():
    with pytest.raises(ValidationError, match="configg"):
        jobs.JobRequest.model_validate({"configg": {}})


def test_progress_and_events_from_metrics():
    assert jobs.progress([], 10) == {"step": 0, "total_steps": 10, "fraction": 0.0}
    line = {"step": 4, "version": 4, "reward_mean": 0.25, "failed": 2}
    assert jobs.progress([line], 10) == {
        "step": 4,
        "total_steps": 10,
        "fraction": 0.4,
        "reward_mean": 0.25,
        "policy_version": 4,
        "failed_episodes": 2,
    }
    assert [e[:2] for e in jobs.step_events(line)] == [("rl.iteration.complete", "step 4: reward 0.250")]
    evaluated = {"step": 5, "eval_reward_mean": 0.5, "eval_episodes": 4, "eval_failed": 0, "seeds": []}
    assert jobs.evaluation_event(evaluated) == (
        "rl.evaluation.complete",
        "evaluation after step 5: reward 0.500",
        {"step": 5, "eval_reward_mean": 0.5, "eval_episodes": 4, "eval_failed": 0},
    )
    assert jobs.RAY_STATUS["STOPPED"] == "cancelled" and set(jobs.RAY_STATUS.values()) <= set(jobs.Status.__args__)


@pytest.mark.parametrize(
    "body",
    [
        {"config": {"model": {"name": "tiny-random"}}, "task_app_url": "file:///etc/passwd"},
        {"data": {"endpoint_base_url": "file:///etc/passwd", "config": SYNTH}},
        {"config": {"services": {"task_url": "file:///etc/passwd"}}},
    ],
)
def test_a_task_app_url_must_be_http_or_https(body):
    with pytest.raises(ConfigError, match=r"services.task_url: a task app URL must be http or https, not 'file'"):
        jobs.job_config(jobs.JobRequest.model_validate(body))


def test_a_null_in_a_job_config_is_refused_by_name_not_a_500():
    """A job's config is written as TOML for its driver, and TOML has no null: a
    null inside a free-form table (a task's env_config) passed validation and then
    failed the write, a 500 that left an empty job folder behind."""
    synth = {**SYNTH, "rollout": {**SYNTH["rollout"], "env_config": {"x": None, "ok": [1, None]}}}
    request = jobs.JobRequest.model_validate(
        {"data": {"endpoint_base_url": "http://127.0.0.1:8201", "config": synth, "model": "tiny-random"}}
    )
    with pytest.raises(ConfigError, match=r"task.env_config.x, task.env_config.ok\[1\]: null"):
        jobs.job_config(request)
