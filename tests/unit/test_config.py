"""Every shipped config parses; mistakes name the key."""

from __future__ import annotations

import tomllib

import pytest

from rlgate.config import ConfigError, dump_config, load_config, parse_config, with_changes
from tests.support import ROOT


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_parses(path):
    config = load_config(path)
    assert config.model.name and config.rollout.replicas >= 1


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_a_dumped_config_reads_back_the_same(path, tmp_path):
    config = load_config(path)
    assert load_config(dump_config(config, tmp_path / "again.toml")) == config


def test_unknown_keys_are_named():
    with pytest.raises(ConfigError, match=r"rollout\.replica: unknown key"):
        parse_config({"rollout": {"replica": 2}})
    with pytest.raises(ConfigError, match=r"modle: unknown key"):
        parse_config({"modle": {"name": "tiny-random"}})


def test_bad_values_are_named():
    with pytest.raises(ConfigError, match=r"rollout\.replicas: .*greater than or equal to 1.*got 0"):
        parse_config({"rollout": {"replicas": 0}})
    with pytest.raises(ConfigError, match=r"rollout\.engine: .*'vllm', 'hf' or 'auto'"):
        parse_config({"rollout": {"engine": "tensorrt"}})
    with pytest.raises(ConfigError, match=r"direct_port 65535 \+ one port per colocated replica \(2\)"):
        parse_config({"rollout": {"replicas": 2}, "gateway": {"colocate": True, "direct_port": 65535}})
    assert parse_config({"rollout": {"replicas": 2}, "gateway": {"colocate": True, "direct_port": 65534}})


def test_task_app_hosts_entries_are_checked_and_none_by_default():
    assert parse_config({}).jobs.task_app_hosts == []  # runs may call task apps at public addresses only
    hosts = ["127.0.0.1", "::1", "10.0.0.0/8", "taskapp.internal"]
    assert parse_config({"jobs": {"task_app_hosts": hosts}}).jobs.task_app_hosts == hosts
    with pytest.raises(ConfigError, match=r"jobs.task_app_hosts: 'http://taskapp:8201' is not a URL entry"):
        parse_config({"jobs": {"task_app_hosts": ["http://taskapp:8201"]}})
    with pytest.raises(ConfigError, match=r"services.task_url: a task app URL must be http or https, not 'ftp'"):
        parse_config({"services": {"task_url": "ftp://taskapp/"}})


def test_a_colocated_gateway_has_as_many_replicas_as_engines():
    assert parse_config({"gateway": {"colocate": True, "replicas": 3}}).rollout.replicas == 3
    assert parse_config({"gateway": {"colocate": True}, "rollout": {"replicas": 2}}).gateway.replicas == 2
    split = parse_config({"gateway": {"replicas": 3}, "rollout": {"replicas": 2}})
    assert (split.gateway.replicas, split.rollout.replicas) == (3, 2)  # split: stateless gateways, engines apart
    with pytest.raises(ConfigError, match=r"gateway.replicas \(3\) and rollout.replicas \(2\) disagree"):
        parse_config({"gateway": {"colocate": True, "replicas": 3}, "rollout": {"replicas": 2}})


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "absent.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[model\nname = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(broken)
    with pytest.raises(ConfigError, match="a folder, not a config file"):
        load_config(tmp_path)
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\x80\x81\xfe\xff")
    with pytest.raises(ConfigError, match="not a text file"):
        load_config(binary)


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_a_config_with_no_changes_is_the_same_config(path):
    config = load_config(path)
    assert with_changes(config, {}) == config


def test_changes_are_checked_once_over_the_whole_tree():
    dataset = parse_config({"task": {"dataset": "rows.jsonl", "reward": "m:f"}})
    switched = with_changes(dataset, {"task": {"builtin": "vowels", "dataset": None, "reward": None}})
    assert (switched.task.builtin, switched.task.dataset, switched.task.reward) == ("vowels", None, None)
    assert dataset.task.dataset == "rows.jsonl"  # the original is not changed
    with pytest.raises(ConfigError, match="set one of \\[task\\] dataset and \\[services\\] task_url"):
        with_changes(dataset, {"services": {"task_url": "http://127.0.0.1:9000"}}, "--task-app")
    with pytest.raises(ConfigError, match="--run-name: gateway.run_name"):
        with_changes(dataset, {"gateway": {"run_name": "no spaces here"}}, "--run-name")
    with pytest.raises(ConfigError, match=r"\[task\] max_tokens \(8192\) is more than the gateway allows"):
        with_changes(dataset, {"task": {"max_tokens": 8192}})
    assert with_changes(dataset, {"task": {"max_tokens": 8192}, "gateway": {"max_completion_tokens": 8192}})
    assert parse_config({"gateway": {"max_completion_tokens": 8}})  # nothing plays [task] max_tokens here
    with pytest.raises(ConfigError, match="a run's trainer has GPUs of its own, and its pushes go by file"):
        with_changes(dataset, {"rollout": {"weight_sync": "ipc"}})
    colocated = parse_config({"gateway": {"colocate": True}, "rollout": {"replicas": 2}})
    assert with_changes(colocated, {"model": {"name": "tiny-random"}}).gateway.replicas == 2


def test_cluster_yaml_is_a_launcher_config_with_cpu_head_and_gpu_workers():
    import yaml

    cluster = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    types = cluster["available_node_types"]
    head = types[cluster["head_node_type"]]
    assert "GPU" not in head["resources"]
    gpu_types = [t for t in types.values() if t["resources"].get("GPU", 0) > 0]
    assert gpu_types and all(t["max_workers"] >= t["min_workers"] for t in types.values())
    assert sum(t["max_workers"] for t in types.values()) <= cluster["max_workers"]
    assert any("[gpu]" in command for command in cluster["setup_commands"])


def test_the_config_reference_lists_every_field():
    from pydantic import BaseModel

    from rlgate.config import RLGateConfig

    reference = (ROOT / "docs" / "configuration.md").read_text()
    for section_name, section in RLGateConfig.model_fields.items():
        if not (isinstance(section.annotation, type) and issubclass(section.annotation, BaseModel)):
            assert f"`{section_name}`" in reference, f"docs/configuration.md lacks the top-level {section_name}"
            continue
        assert f"[{section_name}]" in reference, f"docs/configuration.md has no [{section_name}] section"
        for field_name in section.annotation.model_fields:
            assert f"`{field_name}`" in reference, f"docs/configuration.md lacks [{section_name}] {field_name}"


def test_varieties_fill_in_what_is_left_unset():
    dapo = parse_config({"algorithm": {"variety": "dapo"}}).algorithm.resolved(max_staleness=0)
    assert dapo.clip_high == 0.28 and dapo.aggregation == "token_mean" and dapo.drop_equal_reward_groups
    explicit = parse_config({"algorithm": {"variety": "dapo", "clip_high": 0.3, "aggregation": "seq_mean_token_mean"}})
    assert explicit.algorithm.resolved(0).clip_high == 0.3
    assert explicit.algorithm.resolved(0).aggregation == "seq_mean_token_mean"
    grpo = parse_config({}).algorithm
    assert grpo.resolved(0).loss == "ppo_clip" and grpo.resolved(0).clip_high == grpo.clip_low
    assert grpo.resolved(2).loss == "decoupled_ppo"  # off-policy tokens need the behaviour correction
    assert parse_config({"algorithm": {"variety": "gspo"}}).algorithm.resolved(2).loss == "gspo"


def test_training_and_compute_checks_name_the_keys():
    with pytest.raises(ConfigError, match=r"training: batch_size \(6\) must be a multiple of group_size \(4\)"):
        parse_config({"training": {"batch_size": 6, "group_size": 4}})
    with pytest.raises(ConfigError, match=r"compute.rollout_replicas \(2\) and rollout.replicas \(3\) disagree"):
        parse_config({"compute": {"rollout_replicas": 2}, "rollout": {"replicas": 3}})
    assert parse_config({"compute": {"rollout_replicas": 2}}).rollout.replicas == 2
    with pytest.raises(ConfigError, match=r"training.learning_rate: .*greater than 0"):
        parse_config({"training": {"learning_rate": 0}})
    with pytest.raises(ConfigError, match=r"algorithm.variety: .*'grpo', 'dr_grpo', 'dapo', 'gspo' or 'rloo'"):
        parse_config({"algorithm": {"variety": "ppo"}})


def test_the_serve_config_file_is_valid_and_names_our_deployments(monkeypatch):
    """configs/serve.yaml passes Serve's own schema and configures the deployments serve_app builds."""
    import yaml
    from ray.serve.schema import ServeDeploySchema

    data = yaml.safe_load((ROOT / "configs" / "serve.yaml").read_text())
    schema = ServeDeploySchema.model_validate(data)
    [application] = schema.applications
    assert application.import_path == "serve_app:app" and application.route_prefix == "/"
    parse_config(tomllib.loads((ROOT / application.args["config"]).read_text()))  # the TOML it names parses
    assert {d.name for d in application.deployments} == {"Gateway", "RolloutServer"}
    rollout = next(d for d in application.deployments if d.name == "RolloutServer")
    assert rollout.autoscaling_config["min_replicas"] >= 1
    from rlgate.serving.routing import PROXY_READY_ENV, serve_start_options

    monkeypatch.delenv(PROXY_READY_ENV, raising=False)  # the controller's settings, as serve.start gets them
    assert data["controller_options"] == serve_start_options()["controller_options"]


def test_the_documented_limits_are_the_defaults():
    """The defaults SECURITY.md and docs/reliability.md state."""
    import inspect

    from rlgate.serving.routing import OwnerRouter
    from rlgate.sessions.journal import COMPACT_BYTES
    from rlgate.sessions.trajectory_files import READ_BYTES

    gateway = parse_config({}).gateway
    assert gateway.max_body_bytes == 4 * 2**20
    assert (gateway.max_messages, gateway.max_n, gateway.max_completion_tokens) == (1024, 16, 4096)
    assert (gateway.max_session_interactions, gateway.max_session_tokens) == (1024, 2**20)
    assert READ_BYTES == 32 * 2**20 and COMPACT_BYTES == 64 * 2**20
    waits = inspect.signature(OwnerRouter.initialize_state).parameters["owner_wait_s"]
    assert waits.default == 120.0  # "up to two minutes" in the proxy for a restarting owner
