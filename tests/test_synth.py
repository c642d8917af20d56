"""The synth-ai RL TOML shape is recognised, mapped, and refused by name where it asks for what we lack."""

from __future__ import annotations

import pytest

from rlgate.config import ConfigError, parse_config
from rlgate.synth import is_synth_shape

SYNTH = {
    "algorithm": {"type": "online", "method": "policy_gradient", "variety": "gspo"},
    "services": {"task_url": "http://127.0.0.1:8101"},
    "model": {"base": "Qwen/Qwen3-0.6B", "trainer_mode": "full", "label": "math-rl"},
    "rollout": {
        "env_name": "math",
        "policy_name": "solver",
        "max_turns": 3,
        "episodes_per_batch": 32,
        "max_concurrent_rollouts": 6,
        "env_config": {"difficulty": "easy"},
    },
    "training": {
        "num_epochs": 2,
        "iterations_per_epoch": 10,
        "batch_size": 16,
        "group_size": 4,
        "learning_rate": 5e-5,
        "gradient_accumulation_steps": 2,
        "log_interval": 1,
    },
    "evaluation": {"instances": 2, "every_n_iters": 5, "seeds": [7, 8]},
    "tags": {"team": "rl"},
    "smoke": {"max_steps": 3},
}


def with_(**changes):
    data = {section: dict(body) if isinstance(body, dict) else body for section, body in SYNTH.items()}
    for path, value in changes.items():
        section, key = path.split("__")
        data.setdefault(section, {})[key] = value
    return data


def test_a_synth_config_is_mapped_onto_ours():
    config = parse_config(SYNTH)
    assert config.algorithm.variety == "gspo"
    assert config.model.name == "Qwen/Qwen3-0.6B" and config.served_model_name == "math-rl"
    assert config.services.task_url == "http://127.0.0.1:8101"
    assert (config.training.batch_size, config.training.group_size, config.training.learning_rate) == (16, 4, 5e-5)
    assert config.training.total_steps == 20 and config.training.grad_accumulation == 2
    assert (config.task.env_name, config.task.policy_name, config.task.max_turns) == ("math", "solver", 3)
    assert config.task.max_concurrent == 6 and config.task.env_config == {"difficulty": "easy"}
    assert config.evaluation.seeds == [7, 8] and config.evaluation.every_n_iters == 5
    assert config.tags == {"team": "rl"}
    assert config.compute.gpus_per_worker == 0 and config.rollout.num_gpus == 0  # no [compute]: CPU
    assert parse_config(with_(jobs__task_app_hosts=["127.0.0.1"])).jobs.task_app_hosts == ["127.0.0.1"]


def test_episodes_per_batch_is_the_batch_size_when_training_has_none():
    data = with_()
    del data["training"]["batch_size"]
    assert parse_config(data).training.batch_size == 32


@pytest.mark.parametrize(
    "compute, rollout_gpus, replicas, workers, per_worker",
    [
        ({"compute": {"gpu_type": "cpu", "gpu_count": 0}}, 0, 1, 1, 0),
        ({"compute": {"gpu_type": "H100", "gpu_count": 1}}, 0.5, 1, 1, 0.5),  # one GPU, shared
        ({"compute": {"gpu_type": "H100", "gpu_count": 4}}, 1, 1, 3, 1),  # one for rollouts, three train
        (
            {"compute": {"gpu_type": "H100", "gpu_count": 8}, "topology": {"gpus_for_vllm": 2, "gpus_for_training": 6}},
            1,
            2,
            6,
            1,
        ),
        (  # two tensor-parallel replicas of two GPUs each
            {
                "compute": {"gpu_type": "H100", "gpu_count": 8},
                "topology": {"gpus_for_vllm": 4, "gpus_for_training": 4, "tensor_parallel": 2},
            },
            2,
            2,
            4,
            1,
        ),
    ],
)
def test_gpus_are_split_between_rollouts_and_training(compute, rollout_gpus, replicas, workers, per_worker):
    config = parse_config({**SYNTH, **compute})
    assert config.rollout.num_gpus == rollout_gpus and config.rollout.replicas == replicas
    assert config.compute.trainer_workers == workers and config.compute.gpus_per_worker == per_worker


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model__source": "ft:job_1"}, r"model.source: continuing from a hosted checkpoint"),
        ({"model__trainer_mode": "lora"}, r"model.trainer_mode: only full fine-tuning"),
        ({"algorithm__type": "offline"}, r"algorithm.type: only 'online'"),
        ({"algorithm__variety": "ppo"}, r"algorithm.variety: Input should be"),
        ({"training__weight_sync_interval": 4}, r"training.weight_sync_interval: weights are pushed after every step"),
        ({"training__lora": {"r": 8}}, r"training.lora: not supported"),
        ({"evaluation__instances": 3}, r"evaluation.instances: must equal the number of seeds \(2\)"),
        ({"rollout__mystery": 1}, r"rollout.mystery: unknown key in a synth-ai config"),
        ({"services__verifier_url": "https://x"}, r"services.verifier_url: hosted verifiers are not supported"),
        (
            {
                "topology__gpus_for_vllm": 4,
                "topology__gpus_for_training": 4,
                "compute__gpu_type": "A10G",
                "compute__gpu_count": 4,
            },
            r"topology: gpus_for_vllm \+ gpus_for_training \(8\) exceed",
        ),
        (
            {
                "topology__gpus_for_vllm": 3,
                "topology__gpus_for_training": 4,
                "topology__tensor_parallel": 2,
                "compute__gpu_type": "H100",
                "compute__gpu_count": 8,
            },
            r"topology: gpus_for_vllm \(3\) must be a multiple of tensor_parallel \(2\)",
        ),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(change, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(with_(**change))


def test_synth_ai_documented_example_is_accepted_whole():
    """Every section of synth-ai's documented RL config, with the values it shows."""
    example = {
        "algorithm": {"type": "online", "method": "policy_gradient", "variety": "gspo"},
        "model": {"base": "Qwen/Qwen3-1.7B", "trainer_mode": "full", "label": "test"},
        "compute": {"gpu_type": "H100", "gpu_count": 2},
        "topology": {
            "type": "single_node_split",
            "gpus_for_vllm": 1,
            "gpus_for_training": 1,
            "gpus_for_ref": 0,
            "tensor_parallel": 1,
        },
        "rollout": {
            "env_name": "math",
            "policy_name": "math",
            "max_turns": 1,
            "episodes_per_batch": 2,
            "max_concurrent_rollouts": 2,
            "batches_per_step": 1,
            "ops": ["agent", "env"],
            "policy_config": {"max_llm_calls": 10, "max_tokens": 512, "temperature": 0.2, "top_p": 0.95},
        },
        "vllm": {"tensor_parallel_size": 1, "max_model_len": 4096},
        "reference": {"placement": "none"},
        "training": {
            "num_epochs": 1,
            "iterations_per_epoch": 1,
            "gradient_accumulation_steps": 1,
            "max_accumulated_minibatch": 1,
            "max_turns": 1,
            "batch_size": 2,
            "group_size": 2,
            "learning_rate": 5e-6,
            "log_interval": 1,
            "weight_sync_interval": 1,
            "weight_sync_verify_checksums": False,
            "weight_sync": {
                "enable": True,
                "targets": ["policy"],
                "mode": "full",
                "direct": True,
                "verify_every_k": 0,
                "chunk_bytes": 0,
            },
        },
        "evaluation": {"instances": 2, "every_n_iters": 1, "seeds": [0, 1]},
        "tags": {"experiment": "my-experiment", "version": "v1"},
    }
    config = parse_config(example)
    assert config.task.ops == ["agent", "env"] and config.task.policy_config["temperature"] == 0.2
    assert (config.rollout.replicas, config.compute.trainer_workers, config.compute.gpus_per_worker) == (1, 1, 1)
    with pytest.raises(ConfigError, match="topology.gpus_for_ref"):
        parse_config({**example, "topology": {**example["topology"], "gpus_for_ref": 1}})
    with pytest.raises(ConfigError, match="judge: LLM judges are not supported"):
        parse_config({**example, "judge": {"type": "llm"}})


def test_native_configs_are_not_mistaken_for_synth():
    assert not is_synth_shape({"model": {"name": "tiny-random"}, "training": {"batch_size": 8}})
    assert is_synth_shape({"model": {"base": "x"}})
