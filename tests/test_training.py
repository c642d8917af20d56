"""train_driver.py end to end, as a user runs it: its own local Ray, the gateway
and a real engine on tiny-random, episodes from the built-in agent through
HTTP, GRPO steps on Ray Train, weights pushed to the engine, then a resume."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlgate.models import prepare_model

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def config(tmp_path, total_steps: int) -> Path:
    path = tmp_path / f"train-{total_steps}.toml"
    path.write_text(f"""
[model]
name = "tiny-random"
[rollout]
max_model_len = 512
kv_cache_gib = 0.5
[gateway]
run_name = "e2e"
run_dir = "{tmp_path / "runs"}"
port = {free_port()}
[training]
batch_size = 8
group_size = 4
learning_rate = 3e-3
total_steps = {total_steps}
save_every = 2
[task]
builtin = "vowels"
max_concurrent = 8
max_tokens = 12
""")
    return path


def train(path: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env |= {
        "RLGATE_ADMIN_KEY": "train-test-admin-key-0123",
        "RAY_AUTH_MODE": "disabled",
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
    }
    return subprocess.run(
        [sys.executable, "train_driver.py", "--config", str(path), *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_train_sync_checkpoint_and_resume(tmp_path):
    first = train(config(tmp_path, total_steps=3))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run = tmp_path / "runs" / "e2e"
    metrics = lines(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3] and [m["version"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        # the engine sampled these tokens with the weights the trainer holds: the push was exact
        assert m["train_logprob_mismatch_max"] < 1e-4
        assert m["staleness"] == 0 and m["dropped"] == 0  # S = 0: nothing older than the current version
        assert m["samples"] == 8
    assert (run / "reward_curve.png").stat().st_size > 0

    # The checkpoint is a Hugging Face folder whose weights moved away from the start.
    states = {p.parent: json.loads(p.read_text()) for p in run.glob("trainer/checkpoint_*/trainer_state.json")}
    latest = max(states, key=lambda p: states[p]["next_command"])
    assert states[latest]["version"] == 3
    trained = load_file(latest / "model" / "model.safetensors")
    start = load_file(prepare_model("tiny-random") / "model.safetensors")
    assert any(not torch.equal(trained[name], start[name]) for name in start)

    resumed = train(config(tmp_path, total_steps=5), "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    metrics = lines(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5] and metrics[-1]["version"] == 5
    assert all(m["train_logprob_mismatch_max"] < 1e-4 for m in metrics[3:])  # engines restarted on trained weights

    # Every step trained on trajectories no other step used, and each was sampled by the version it trained.
    batches = lines(run / "batches.jsonl")
    used = [seq for b in batches for seq in b["seqs"]]
    assert len(used) == len(set(used)) == 5 * 8
    records = {r["seq"]: r for f in sorted((run / "trajectories").glob("*.jsonl")) for r in lines(f)}
    for batch in batches:
        for seq in batch["seqs"]:
            sampled = {v for m, v in zip(records[seq]["loss_mask"], records[seq]["versions"]) if m}
            assert sampled == {batch["step"] - 1}

    again = train(config(tmp_path, total_steps=5))
    assert again.returncode != 0 and "already has checkpoints; pass --resume" in again.stderr
