"""The driver's word while a wait is slow: the gateway's deploy says where it stands."""

from __future__ import annotations

import re
import threading

from ray.serve.schema import (
    ApplicationStatus,
    ApplicationStatusOverview,
    DeploymentStatus,
    DeploymentStatusOverview,
    DeploymentStatusTrigger,
    ReplicaState,
    ServeStatus,
)

from rlgate.training import driver


def asked(times: int, answer):
    """A state function, and an event set once it has been asked ``times`` times
    (the block then ends; every answer asked for is printed by the time it has)."""
    calls, enough = [], threading.Event()

    def state() -> str:
        calls.append(None)
        if len(calls) >= times:
            enough.set()
        return answer(len(calls))

    return state, enough


def test_a_slow_wait_says_how_long_and_where_it_stands_and_a_quick_one_says_nothing(capsys):
    state, enough = asked(3, lambda n: f"state {n}")
    with driver.said_while_slow("deploying the gateway", state, every_s=0.05):
        assert enough.wait(30)
    lines = [re.sub(r"after \d+ s", "after N s", line) for line in capsys.readouterr().out.splitlines()]
    assert lines[:2] == [
        "rlgate: still deploying the gateway after N s: state 1",
        "rlgate: still deploying the gateway after N s: state 2",
    ]
    with driver.said_while_slow("deploying the gateway", lambda: "never asked", every_s=60.0):
        pass
    assert capsys.readouterr().out == ""


def test_a_state_that_cannot_be_read_is_said_and_the_wait_goes_on(capsys):
    def fails(n: int) -> str:
        raise TimeoutError("the controller did not answer")

    state, enough = asked(2, fails)
    with driver.said_while_slow("deploying the gateway", state, every_s=0.05):
        assert enough.wait(30)
    assert "its state unknown (TimeoutError: the controller did not answer)" in capsys.readouterr().out


def test_an_applications_state_names_each_deployment_its_replicas_and_serves_message(monkeypatch):
    def deployment(status, replicas, message=""):
        trigger = DeploymentStatusTrigger.CONFIG_UPDATE_STARTED
        return DeploymentStatusOverview(status=status, status_trigger=trigger, replica_states=replicas, message=message)

    deployments = {
        "Gateway": deployment(DeploymentStatus.HEALTHY, {ReplicaState.RUNNING: 1}),
        "RolloutServer": deployment(
            DeploymentStatus.UPDATING, {ReplicaState.STARTING: 1}, "Deployment 'RolloutServer' has 1 replica starting."
        ),
    }
    app = ApplicationStatusOverview(
        status=ApplicationStatus.DEPLOYING, message="", last_deployed_time_s=0.0, deployments=deployments
    )
    monkeypatch.setattr(driver.serve, "status", lambda: ServeStatus(applications={"rlgate": app}))
    assert driver.app_state("rlgate") == (
        "DEPLOYING; Gateway HEALTHY (1 RUNNING); RolloutServer UPDATING (1 STARTING): "
        "Deployment 'RolloutServer' has 1 replica starting."
    )
    assert driver.app_state("other") == "the application is not there yet"


def test_ctrl_c_while_a_step_is_trained_and_recorded_stops_the_run_once_it_is_recorded():
    """A step the workers may have saved must reach the run's log: the first Ctrl-C
    there waits for the step's end, a second stops at once, and outside a step it acts at once."""
    import os
    import signal

    import pytest

    ctrl_c = driver.HeldCtrlC()
    before = signal.signal(signal.SIGINT, ctrl_c)
    recorded = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with ctrl_c.held():
                os.kill(os.getpid(), signal.SIGINT)
                recorded.append("step 3")  # the handler returned: the step goes on to be recorded
        assert recorded == ["step 3"]
        with pytest.raises(KeyboardInterrupt):
            with ctrl_c.held():
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)  # again: now
                recorded.append("step 4")
        assert recorded == ["step 3"]
        with ctrl_c.held():  # nothing pending from before
            recorded.append("step 5")
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # between steps: at once
            for _ in range(100):  # (delivered at the next bytecode; a few for good measure)
                pass
    finally:
        signal.signal(signal.SIGINT, before)
    assert recorded == ["step 3", "step 5"]


def test_a_resumed_runs_log_drops_the_steps_after_its_checkpoint(tmp_path):
    """Stopped between checkpoints, a run trains the later steps again when resumed:
    their lines go from metrics.jsonl, batches.jsonl and eval.jsonl (a torn one too)."""
    import json

    from rlgate.training.runlog import RunLog

    for name in ("metrics.jsonl", "batches.jsonl"):
        lines = [json.dumps({"step": step, "x": step}) for step in (1, 2, 3, 4)]
        (tmp_path / name).write_text("\n".join(lines) + '\n{"step": 5, "x"')
    (tmp_path / "eval.jsonl").write_text(json.dumps({"step": 2}) + "\n" + json.dumps({"step": 4}) + "\n")
    assert RunLog.forget_after(tmp_path, 2) == [3, 4]
    for name in ("metrics.jsonl", "batches.jsonl"):
        assert [json.loads(line)["step"] for line in (tmp_path / name).read_text().splitlines()] == [1, 2]
    assert (tmp_path / "eval.jsonl").read_text() == json.dumps({"step": 2}) + "\n"
    assert RunLog.forget_after(tmp_path, 2) == [] and RunLog.forget_after(tmp_path / "none", 2) == []


def test_a_step_saved_but_not_logged_is_logged_from_its_checkpoint_when_resumed(tmp_path):
    """A driver killed after the workers saved step 3's checkpoint, before it wrote the
    step's lines: the resumed run writes them from the checkpoint, marked recovered,
    and only where they are missing."""
    import json

    from rlgate.run import STATE_FILE, checkpoint_name, checkpoints_dir
    from rlgate.training.runlog import RunLog

    run = tmp_path / "run"
    folder = checkpoints_dir(run) / checkpoint_name(3)
    (folder / "model").mkdir(parents=True)
    line = {"version": 3, "reward_mean": 0.25, "samples": 8, "collect_s": 1.5}
    metrics = {"stale_tokens_dropped": 0, "trained_tokens": 96, "loss": -0.125}  # as rank 0 reported them
    state = {"step": 3, "buffer": {"watermark": 24}, "line": line, "seqs": [17, 18]}
    (folder / STATE_FILE).write_text(json.dumps({"next_command": 3, "version": 3, "driver": state, "metrics": metrics}))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "version": s}) + "\n" for s in (1, 2)))
    (run / "batches.jsonl").write_text("".join(json.dumps({"step": s, "seqs": [s]}) + "\n" for s in (1, 2, 3)))

    start = driver.resume_point(run, resume=True)
    assert (start.step, start.version, start.weights) == (3, 3, folder / "model")
    log = RunLog(run, total_steps=5, first_step=start.step, show=False)
    try:
        assert log.complete(start.step, *start.lines) == ["metrics.jsonl"]  # batches.jsonl had it
        assert log.complete(start.step, *start.lines) == []  # once
    finally:
        log.close()
    written = [json.loads(text) for text in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in written] == [1, 2, 3]
    assert written[2] | {"time": 0} == {
        "step": 3,
        "time": 0,
        **line,
        "stale_tokens_dropped": 0,
        "train_stale_tokens_dropped": 0,
        "train_trained_tokens": 96,
        "train_loss": -0.125,
        "recovered": True,
    }
    assert [json.loads(text)["seqs"] for text in (run / "batches.jsonl").read_text().splitlines()] == [[1], [2], [3]]
    # a checkpoint saved before checkpoints kept their step's lines: nothing to write from
    state.pop("line")
    (folder / STATE_FILE).write_text(json.dumps({"next_command": 3, "version": 3, "driver": state, "metrics": metrics}))
    assert driver.resume_point(run, resume=True).lines is None
