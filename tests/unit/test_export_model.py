"""`rlgate export RUN OUT [--step N]`: a run's checkpoint as a Hugging Face model
folder (loadable by transformers) with a model card; bad requests say what is wrong."""

from __future__ import annotations

import json
import shutil

import pytest

from rlgate import run as runs
from rlgate.cli.export_model import export_model
from rlgate.cli.main import main


@pytest.fixture
def trained(tmp_path, tiny_path):
    """A run folder as a driver leaves it: config, metrics, checkpoints at steps 2 and 4."""
    folder = tmp_path / "runs" / "arith"
    (folder / "config.toml").parent.mkdir(parents=True)
    (folder / "config.toml").write_text(
        '[model]\nname = "org/base-model"\n[algorithm]\nvariety = "dapo"\n'
        "[training]\nbatch_size = 8\ngroup_size = 4\nlearning_rate = 0.001\n"
    )
    steps = [{"step": s, "reward_mean": s / 10, "samples": 8, "note": "x"} for s in (1, 2, 3, 4)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in steps))
    for step in (2, 4):
        name = runs.checkpoint_name(step) if step == 4 else f"checkpoint_2026-12-02_0{step}"  # as older runs named it
        checkpoint = runs.checkpoints_dir(folder) / name
        shutil.copytree(tiny_path, checkpoint / "model")
        state = {"next_command": step, "version": step + 10, "driver": {"step": step, "buffer": {}}}
        (checkpoint / runs.STATE_FILE).write_text(json.dumps(state))
    return folder


def test_the_latest_checkpoint_exports_as_a_loadable_model_with_a_card(trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, step = export_model(trained, tmp_path / "out")
    assert step == 4
    assert AutoModelForCausalLM.from_pretrained(out).num_parameters() > 0 and AutoTokenizer.from_pretrained(out)
    card = (out / "README.md").read_text()
    header, body = card.split("---\n")[1], card.split("---\n", 2)[2]
    assert "library_name: transformers" in header and "base_model: org/base-model" in header and "- rlgate" in header
    assert "# arith, step 4" in body and "dapo with the ppo_clip loss, 8 episodes per step" in body
    assert "policy version 14" in body
    assert "| reward_mean | 0.4 |" in body and "note" not in body


def test_a_step_is_chosen_by_number_and_a_missing_one_names_those_there_are(trained, tmp_path, capsys):
    assert main(["export", str(trained), str(tmp_path / "two"), "--step", "2"]) == 0
    assert "rlgate: step 2 of" in capsys.readouterr().out
    assert "| reward_mean | 0.2 |" in (tmp_path / "two" / "README.md").read_text()
    assert main(["export", str(trained), str(tmp_path / "three"), "--step", "3"]) == 2
    assert "has no checkpoint at step 3; it has steps 2, 4" in capsys.readouterr().err
    assert main(["export", str(trained), str(tmp_path / "two")]) == 2  # not over an earlier export
    assert "is not an empty folder; export into a new one" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["export", str(trained), str(tmp_path / "file")]) == 2
    assert "file is not an empty folder" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "typo"), str(tmp_path / "out")]) == 2
    assert f"rlgate: error: no run folder {tmp_path / 'typo'}" in capsys.readouterr().err
    shutil.rmtree(runs.checkpoints_dir(trained) / runs.checkpoint_name(4) / "model")
    assert main(["export", str(trained), str(tmp_path / "four")]) == 2
    assert "holds no model/ (an unfinished checkpoint?); choose another --step" in capsys.readouterr().err
    assert main(["export", str(tmp_path), str(tmp_path / "none")]) == 2
    assert "has no checkpoints (trainer/step-*/); set [training] save_every" in capsys.readouterr().err


def test_a_runs_torn_metrics_line_is_skipped_and_a_failed_export_leaves_nothing(trained, tmp_path, monkeypatch):
    with open(trained / "metrics.jsonl", "a") as log:
        log.write('{"step": 4, "reward_mean": 9')  # the driver was writing when we read
    (tmp_path / "empty").mkdir()
    out, _ = export_model(trained, tmp_path / "empty")  # an empty folder is taken
    assert "| reward_mean | 0.4 |" in (out / "README.md").read_text()

    from rlgate.cli import export_model as module

    def failing(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(module, "model_card", failing)
    with pytest.raises(OSError, match="No space left"):
        export_model(trained, tmp_path / "again")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "runs"]  # no half folder, no leftovers
    monkeypatch.undo()
    assert export_model(trained, tmp_path / "again")[0].is_dir()  # so a retry goes through


def test_a_push_the_hub_cannot_take_says_why_and_keeps_the_folder(trained, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert main(["export", str(trained), str(tmp_path / "out"), "--push-to-hub", "me/arith"]) == 2
    assert "rlgate: error: could not push to the Hub as me/arith: " in capsys.readouterr().err
    assert (tmp_path / "out" / "README.md").is_file()
