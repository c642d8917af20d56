"""[logging]: a run's steps in TensorBoard, W&B (offline) and MLflow, read back with each
tool's own reader; samples decoded from the step's trajectories."""

from __future__ import annotations

import json
import time

import pytest

from rlgate.config import ConfigError, parse_config
from rlgate.training.runlog import RunLog
from rlgate.training.tracking import SAMPLE_COLUMNS, Tracking, markdown_table, numeric, sample_rows

RECORDS = [
    {"task_id": "row-1.0", "reward": 1.0, "input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1], "failed": False},
    {"task_id": "row-1.0", "reward": 0.0, "input_ids": [1, 2], "loss_mask": [0, 0], "failed": True},
    {"task_id": "row-2.1", "reward": 0.5, "input_ids": [1, 5, 6], "loss_mask": [0, 1, 1], "failed": False},
]


def decode(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


def test_samples_are_prompt_completion_and_reward_of_unfailed_trajectories():
    assert sample_rows(3, RECORDS, decode, 4) == [
        [3, "row-1.0", 1.0, "t1 t2", "t3 t4"],
        [3, "row-2.1", 0.5, "t1", "t5 t6"],
    ]
    assert len(sample_rows(3, RECORDS, decode, 1)) == 1
    table = markdown_table([[3, "a|b", 0.25, "line\nbreak", "x"]])
    assert table.splitlines()[0] == "| " + " | ".join(SAMPLE_COLUMNS) + " |"
    assert table.splitlines()[2] == "| 3 | a\\|b | 0.25 | line<br>break | x |"


def test_only_finite_numbers_are_plotted():
    assert numeric({"a": 1, "b": 0.5, "c": float("nan"), "d": "text", "e": True, "f": None}) == {
        "a": 1.0,
        "b": 0.5,
        "e": 1.0,
    }


def steps(folder, settings: dict, model_path, first: int = 0, last: int = 3, scale: float = 10) -> None:
    """A run's steps ``first + 1 .. last`` (reward step / scale); ``first`` > 0: a resumed run."""
    config = parse_config({"logging": settings})
    tracking = Tracking.start(
        config.logging, folder, "tracked", config.model_dump(mode="json"), lambda: str(model_path), first, first > 0
    )
    assert tracking.decode([]) == ""  # the model's tokenizer; these records' ids are made up, so:
    tracking.decode = decode
    log = RunLog(folder, last, first, show=False, tracking=tracking)
    for step in range(first + 1, last + 1):
        log.log(step, {"reward_mean": step / scale, "loss": -step, "note": "text"}, RECORDS)
    log.close()


def test_tensorboard_event_files_hold_every_step_and_the_samples(tmp_path, tiny_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps(tmp_path, {"tensorboard": True, "samples_per_step": 2}, tiny_path)
    # resumed from a checkpoint at step 1: steps 2 and 3 are trained again, and replace the first ones
    steps(tmp_path, {"tensorboard": True, "samples_per_step": 2}, tiny_path, first=1, last=4, scale=100)
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    rewards = [(e.step, round(e.value, 6)) for e in events.Scalars("train/reward_mean")]
    assert rewards == [(1, 0.1), (2, 0.02), (3, 0.03), (4, 0.04)]
    assert "train/note" not in events.Tags()["scalars"]
    [text] = {t for t in events.Tags()["tensors"] if t.startswith("samples")}
    last = events.Tensors(text)[-1]
    assert last.step == 4 and "| 4 | row-2.1 | 0.5 | t1 | t5 t6 |" in last.tensor_proto.string_val[0].decode()
    steps(tmp_path, {"tensorboard": True}, tiny_path, last=2, scale=1000)  # a fresh run under the same name
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("train/reward_mean")] == [(1, 0.001), (2, 0.002)]
    assert len(json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])) == 5  # the record of truth


def test_wandb_offline_runs_go_on_as_one_run_with_a_samples_table_per_step(tmp_path, monkeypatch, tiny_path):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)  # no key: offline, synced later with `wandb sync`
    monkeypatch.setenv("WANDB_SILENT", "true")
    steps(tmp_path, {"wandb": True, "wandb_project": "rlgate-tests"}, tiny_path)
    first_id = (tmp_path / "wandb" / "run_id").read_text()
    # W&B names an offline run's folder by the second it started and the run id: the resumed run, started
    # within the same second, would write into the first one's folder
    time.sleep(1 - time.time() % 1 + 0.01)
    steps(tmp_path, {"wandb": True, "wandb_project": "rlgate-tests"}, tiny_path, first=3, last=4)
    runs = sorted((tmp_path / "wandb" / "wandb").glob("offline-run-*"))
    run_id = (tmp_path / "wandb" / "run_id").read_text()
    assert run_id == first_id and len(runs) == 2 and all(r.name.endswith(run_id) for r in runs)  # one, resumed
    tables = [sorted((r / "files" / "media" / "table").glob("samples_*.table.json")) for r in runs]
    assert [len(t) for t in tables] == [3, 1]  # a table per step
    last = json.loads(tables[1][0].read_text())
    assert last["columns"] == SAMPLE_COLUMNS and last["data"][1] == [4, "row-2.1", 0.5, "t1", "t5 t6"]
    # W&B's own record of the run, to sync: its service process writes it on its own time, after finish() returns
    # (under load it held only the file's header when read at once)
    record, deadline = runs[1] / f"run-{run_id}.wandb", time.monotonic() + 60
    while not all(word in record.read_bytes() for word in (b"reward_mean", b"rlgate-tests", b"samples_per_step")):
        assert time.monotonic() < deadline, record.read_bytes()[-2000:]
        time.sleep(0.2)
    steps(tmp_path, {"wandb": True, "wandb_project": "rlgate-tests"}, tiny_path)  # a fresh run of the same name
    assert (tmp_path / "wandb" / "run_id").read_text() != run_id  # is a W&B run of its own


def test_mlflow_runs_go_on_as_one_run_with_every_step_and_a_samples_table_per_step(tmp_path, monkeypatch, tiny_path):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the run folder's own store
    settings = {"mlflow": True, "mlflow_experiment": "rlgate-tests", "samples_per_step": 2}
    steps(tmp_path, settings, tiny_path)
    run_id = (tmp_path / "mlflow_run_id").read_text()
    steps(tmp_path, settings, tiny_path, first=3, last=4)  # resumed: the same MLflow run goes on
    assert (tmp_path / "mlflow_run_id").read_text() == run_id
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())  # MLflow's own reader
    run = client.get_run(run_id)
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "rlgate-tests"
    rewards = [(m.step, m.value) for m in client.get_metric_history(run_id, "reward_mean")]
    assert sorted(rewards) == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)] and "note" not in run.data.metrics
    tables = sorted(a.path for a in client.list_artifacts(run_id, "samples"))
    assert tables == [f"samples/step-00000{n}.json" for n in (1, 2, 3, 4)]
    table = json.loads((tmp_path / "mlruns" / run.info.experiment_id / run_id / "artifacts" / tables[-1]).read_text())
    assert table["columns"] == SAMPLE_COLUMNS and table["data"][1] == [4, "row-2.1", 0.5, "t1", "t5 t6"]
    (tmp_path / "downloaded").mkdir()
    config = client.download_artifacts(run_id, "config.json", str(tmp_path / "downloaded"))
    assert json.loads(open(config).read())["logging"]["mlflow"] is True  # the run's settings, with the run
    steps(tmp_path, settings, tiny_path)  # a fresh run of the same name is an MLflow run of its own
    assert (tmp_path / "mlflow_run_id").read_text() != run_id


def test_a_tracker_that_fails_mid_run_is_dropped_and_the_run_goes_on(tmp_path, caplog):
    class Broken:
        def log(self, step, metrics, samples):
            raise OSError("disk full")

        def close(self):
            raise AssertionError("a dropped tracker is not closed")

    class Kept:
        def __init__(self):
            self.seen = []

        def log(self, step, metrics, samples):
            self.seen.append(step)

        def close(self):
            self.seen.append("closed")

    kept = Kept()
    log = RunLog(tmp_path, 2, show=False, tracking=Tracking([Broken(), kept], None, 0))
    log.log(1, {"reward_mean": 0.5}, RECORDS)
    log.log(2, {"reward_mean": 0.6}, RECORDS)
    log.close()
    assert kept.seen == [1, 2, "closed"] and len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    assert [r.getMessage() for r in caplog.records if "Broken" in r.getMessage()] == [
        "Broken failed to log (OSError: disk full); the run goes on without it"
    ]


def test_a_missing_tracker_package_is_said_by_name(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def without_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_wandb)
    config = parse_config({"logging": {"wandb": True}})
    with pytest.raises(ImportError, match=r"\[logging\] wandb needs the wandb package: pip install wandb"):
        Tracking.start(config.logging, tmp_path, "run", {}, lambda: "unused")


def test_logging_settings_are_checked():
    with pytest.raises(ConfigError, match="logging.wandb_mode"):
        parse_config({"logging": {"wandb_mode": "sometimes"}})
    with pytest.raises(ConfigError, match="logging.tensorbord: unknown key"):
        parse_config({"logging": {"tensorbord": True}})
