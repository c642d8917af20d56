"""Every shipped config parses; mistakes name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlgate.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_parses(path):
    config = load_config(path)
    assert config.model.name and config.rollout.replicas >= 1


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


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "absent.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[model\nname = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(broken)
