"""A run's identity: the names of its actors and application, and its checkpoints, from one module."""

from __future__ import annotations

import json

from rlgate import run


def test_a_runs_actor_names_read_back_to_the_run():
    assert run.actor_name("demo", "capacity") == "rlgate-demo-capacity"
    assert run.run_of(run.actor_name("job-0a1b", "capacity"), "capacity") == "job-0a1b"
    assert set(run.INHERITED_STATE) < set(run.ROLES)  # a fresh run forgets part of what a finished one leaves


def test_a_run_at_the_root_is_the_rlgate_application():
    assert run.app_name("demo") == "rlgate"
    assert run.app_name("job-0a1b", "/jobs/job-0a1b") == "rlgate-job-0a1b"


def test_checkpoint_states_are_read_from_the_runs_checkpoint_folder(tmp_path):
    assert run.checkpoint_name(20) == "step-000020"
    for step in (1, 2):  # named by step, and as runs before step names were (Ray Train's time stamps)
        folder = run.checkpoints_dir(tmp_path) / (run.checkpoint_name(step) if step == 2 else "checkpoint_2026-12-01")
        folder.mkdir(parents=True)
        (folder / run.STATE_FILE).write_text(json.dumps({"next_command": step, "driver": {"step": step}}))
    (run.checkpoints_dir(tmp_path) / "checkpoint_tmp").mkdir()  # unfinished: no state file
    states = run.checkpoint_states(run.checkpoints_dir(tmp_path))
    assert sorted(s["driver"]["step"] for s in states.values()) == [1, 2]
    assert all(folder.parent == tmp_path / "trainer" for folder in states)
