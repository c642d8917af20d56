"""The synth-ai RL TOML shape is recognised, mapped, and refused by name where it asks for what we lack."""

from __future__ import annotations

import pytest

from rlgate.config import ConfigError, parse_config, parse_config_noting
from rlgate.jobs.synth import is_synth_shape

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
        "batch_size": 8,  # groups: 8 x 4 = 32 episodes per step, as [rollout] episodes_per_batch says
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
        if "__" not in path:  # a top-level key
            data[path] = value
            continue
        section, key = path.split("__")
        data.setdefault(section, {})[key] = value
    return data


def test_a_synth_config_is_mapped_onto_ours():
    config = parse_config(SYNTH)
    assert config.algorithm.variety == "gspo"
    assert config.model.name == "Qwen/Qwen3-0.6B" and config.served_model_name == "math-rl"
    assert config.services.task_url == "http://127.0.0.1:8101"
    assert (config.training.batch_size, config.training.group_size, config.training.learning_rate) == (32, 4, 5e-5)
    assert config.training.total_steps == 20 and config.training.grad_accumulation == 2
    assert (config.task.env_name, config.task.policy_name, config.task.max_turns) == ("math", "solver", 3)
    assert config.task.max_concurrent == 6 and config.task.env_config == {"difficulty": "easy"}
    assert config.evaluation.seeds == [7, 8] and config.evaluation.every_n_iters == 5
    assert config.tags == {"team": "rl"}
    assert config.compute.gpus_per_worker == 0 and config.rollout.num_gpus == 0  # no [compute]: CPU
    assert parse_config(with_(jobs__task_app_hosts=["127.0.0.1"])).jobs.task_app_hosts == ["127.0.0.1"]


def test_trainer_mode_lora_trains_an_adapter_with_synth_ais_lora_table():
    lora = {"r": 8, "alpha": 16, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"]}
    config = parse_config(with_(model__trainer_mode="lora", training__lora=lora)).training.lora
    assert (config.rank, config.alpha, config.dropout, config.target_modules) == (8, 16.0, 0.05, ["q_proj", "v_proj"])
    both = {"model__trainer_mode": "lora", "policy__trainer_mode": "lora"}
    older = parse_config(with_(**both, lora={"r": 4})).training.lora  # the older top-level [lora]
    assert older.rank == 4 and older.target_modules == "all-linear"
    assert parse_config(with_(model__trainer_mode="lora")).training.lora.rank == 16  # rlgate's defaults
    config, ignored = parse_config_noting(with_(training__lora=lora))  # trainer_mode "full": the table weighs nothing
    assert config.training.lora is None
    assert "training.lora: trainer_mode is 'full': the whole model trains, no adapter" in ignored


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
        (
            {"model__trainer_mode": "qlora"},
            r"model.trainer_mode: full fine-tuning \('full'\) or 'lora' is supported, not 'qlora'",
        ),
        ({"algorithm__type": "offline"}, r"algorithm.type: only 'online'"),
        ({"algorithm__variety": "ppo"}, r"algorithm.variety: Input should be"),
        ({"training__weight_sync_interval": 4}, r"training.weight_sync_interval: weights are pushed after every step"),
        ({"model__trainer_mode": "lora", "training__lora": {"rank": 8}}, r"training.lora.rank: unknown LoRA setting"),
        ({"training__lora": 8}, r"training.lora: a table of r, alpha, dropout and target_modules"),
        ({"policy__trainer_mode": "qlora"}, r"policy.trainer_mode: 'qlora' differs from \[model\] trainer_mode"),
        ({"policy__trainer_mode": "lora"}, r"policy.trainer_mode: 'lora' differs from \[model\] trainer_mode 'full'"),
        ({"policy__source": "ft:job_1"}, r"policy.source: continuing from a hosted checkpoint"),
        ({"policy__model_name": "Qwen/Qwen3-4B"}, r"policy.model_name: 'Qwen/Qwen3-4B' differs from \[model\] base"),
        ({"training__weight_sync": {"bogus": 1}}, r"training.weight_sync.bogus: unknown key"),
        ({"training__rewards": {"bogus": 1}}, r"training.rewards.bogus: unknown key"),
        (
            {"training__rewards": {"step_rewards_enabled": True, "step_rewards_beta": 0.5}},
            r"weighted step rewards",
        ),
        ({"type": "sft"}, r"type: 'sft': this is an RL config endpoint"),
        ({"training__step_rewards_enabled": True, "training__step_rewards_beta": 0.5}, r"weighted step rewards"),
        ({"policy__model": "Qwen/Qwen3-4B"}, r"policy.model: 'Qwen/Qwen3-4B' differs from \[model\] base"),
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
        (  # was a ZeroDivisionError: a 500
            {"topology__gpus_for_vllm": 1, "topology__gpus_for_training": 1, "topology__tensor_parallel": 0}
            | {"compute__gpu_type": "H100", "compute__gpu_count": 2},
            r"topology.tensor_parallel: at least 1 GPU per replica, not 0",
        ),
        ({"compute__gpu_type": "H100", "compute__gpu_count": float("inf")}, r"a value it cannot take"),  # JSON 1e400
        ({"evaluation__seeds": {"a": 1}, "evaluation__instances": 2}, r"evaluation.seeds: a list of seeds"),
        ({"evaluation__seeds": [1], "evaluation__instances": 10**9}, r"evaluation.instances: a whole number"),
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
    with pytest.raises(ConfigError, match="judge: LLM judges are not supported"):
        parse_config({**example, "judge": {"type": "llm"}})


def test_native_configs_are_not_mistaken_for_synth():
    assert not is_synth_shape({"model": {"name": "tiny-random"}, "training": {"batch_size": 8}})
    assert is_synth_shape({"model": {"base": "x"}})


def test_every_rl_config_shipped_in_synth_ai_parses_with_synth_ais_meaning():
    """The RL configs in the synth-ai 0.4.4 wheel (its math and crafter demos) map
    whole: batch_size in groups, the policy's sampling, a KL reference, the data
    split and seed, evaluation instances; what changes nothing here is listed."""
    import tomllib
    import zipfile

    from rlgate.jobs.synth import map_synth
    from tests.support import synth_ai_wheel

    shipped = {}
    with zipfile.ZipFile(synth_ai_wheel()) as wheel:
        for name in wheel.namelist():
            if name.endswith(".toml"):
                data = tomllib.loads(wheel.read(name).decode())
                if data.get("type") == "rl" or data.get("algorithm", {}).get("type") == "online":
                    shipped[name] = data
    assert len(shipped) == 4, sorted(shipped)  # math and crafter, each in two places
    for name, data in shipped.items():
        mapped = map_synth(data, name)
        config = parse_config(mapped.config, source=name)  # every key mapped, ignored or valid
        assert config.training.total_steps >= 1, name
    math = shipped["synth_ai/cli/demo_apps/math/config.toml"]
    mapped = map_synth(math)
    config = parse_config(mapped.config)
    assert (config.training.batch_size, config.training.group_size) == (32, 16)  # 2 groups of 16
    assert config.task.policy_config == {"max_tokens": 1028, "temperature": 0.2}
    assert config.algorithm.kl_coef == 0.04  # [reference] placement = "dedicated"
    assert config.task.env_config == {"split": "train"} and config.evaluation.env_config == {"split": "validation"}
    assert config.task.seed_start == 0 and len(config.evaluation.seeds) == 32  # 32 instances over 16 seeds
    assert config.evaluation.seeds[:17] == [*range(16), 0] and config.tags == {"experiment": "math_single_step_qwen17"}
    ignored = {item.split(":")[0] for item in mapped.ignored}
    assert {"reference.port", "training.reward_positive", "policy.inference_url", "topology.gpus_for_ref"} <= ignored
    crafter = map_synth(shipped["synth_ai/cli/demo_apps/crafter/rl_from_base_qwen4b.toml"])
    assert parse_config(crafter.config).training.batch_size == 64  # episodes_per_batch, no batch_size given
    assert "training.step_rewards_enabled" in {item.split(":")[0] for item in crafter.ignored}  # weighted 0


def test_what_synth_ais_sdk_adds_or_moves_keeps_its_meaning():
    """What the SDK sends beside what its user wrote: [policy] model_name with
    model, the reference asked for in [compute.topology] while the SDK writes
    [reference] placement = "none", nested [training.rewards] and weight_sync
    keys that weigh nothing, a verifier that is off; all accepted as meant, and
    every key that changes nothing listed."""
    from rlgate.jobs.synth import map_synth

    sent = with_(
        policy={"model": "Qwen/Qwen3-0.6B", "model_name": "Qwen/Qwen3-0.6B", "trainer_mode": "full", "label": "x"},
        compute={"gpu_type": "cpu", "gpu_count": 1, "topology": {"reference_placement": "shared"}},
        reference={"placement": "none"},
        verifier={"reward_blend": {"env": 0.0, "outcome": 1.0}, "options": {"provider": "openai"}},
        training__rewards={"step_rewards_enabled": False},
        training__weight_sync={"enable": True, "targets": ["policy"], "direct": True, "verify_every_k": 4},
        training__max_turns=1,
    )
    mapped = map_synth(sent)
    config = parse_config(sent)
    assert config.model.name == "Qwen/Qwen3-0.6B"
    assert config.algorithm.kl_coef == 0.04  # the topology's reference, not the SDK's "none"
    assert config.task.max_turns == 1
    ignored = {item.split(":")[0] for item in mapped.ignored}
    expected = {
        "training.rewards.step_rewards_enabled",
        "training.weight_sync.direct",
        "training.weight_sync.verify_every_k",
        "verifier.reward_blend",
        "verifier.options",
        "rollout.max_turns",  # 3 in [rollout], 1 in [training]: the latter wins, and it is said
        "policy.trainer_mode",
        "policy.label",
    }
    assert expected <= ignored, expected - ignored
    only_model_name = with_(policy={"model_name": "Qwen/Qwen3-1.7B"}, model={"trainer_mode": "full"})
    assert parse_config(only_model_name).model.name == "Qwen/Qwen3-1.7B"


@pytest.mark.parametrize(
    ("section", "says"),
    [
        ({"topology": {"gpus_for_vllm": 1, "gpus_for_training": 1}}, "compute.gpu_count: GPUs are asked for"),
        ({"compute": {"gpu_type": "H100"}}, "compute.gpu_count: GPUs are asked for"),
        ({"policy": {"repetition_penalty": 1.1}}, "policy.repetition_penalty"),
    ],
)
def test_what_would_silently_change_a_synth_run_is_refused(section, says):
    """GPUs asked for without a count trained on the CPU; a repetition penalty was
    passed to task apps the gateway then refused on every episode."""
    data = {"type": "rl", "model": {"base": "Qwen/Qwen3-0.6B"}, "training": {"batch_size": 4, "group_size": 2}}
    for name, values in section.items():
        data[name] = {**data.get(name, {}), **values}
    with pytest.raises(ConfigError, match=says):
        parse_config(data)
    if "topology" in section:  # on the CPU, by its own word, the topology's GPUs mean nothing
        cpu = parse_config({**data, "compute": {"gpu_type": "cpu", "gpu_count": 1}})
        assert cpu.compute.gpus_per_worker == 0
