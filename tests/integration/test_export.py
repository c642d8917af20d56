"""`rlgate trajectories export` as a user runs it: real records of a served
session, saved by the trajectory store's own file code, exported by the CLI (a
process of its own) and read back with pandas and datasets, list columns intact
and text decoded beside the token ids."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlgate.cli.export import sampled_spans
from rlgate.sessions.trajectory_files import TrajectoryFiles
from tests.support import client, start


async def test_a_runs_records_export_to_parquet_that_pandas_and_datasets_read(served, tiny_tokenizer, tmp_path):  # noqa: F811
    import datasets
    import pandas

    http, _, saved = served
    key = await start(http)
    chat = client(http, key).chat.completions
    asked = [{"role": "user", "content": "Hello"}]
    first = await chat.create(model="tiny-random", messages=asked, max_tokens=4, temperature=0)
    said = first.choices[0].message.content
    history = asked + [{"role": "assistant", "content": said}, {"role": "user", "content": "Go on"}]
    second = await chat.create(model="tiny-random", messages=history, max_tokens=3, temperature=0)
    await http.post("/rl/set_reward", json={"reward": 0.5}, headers={"Authorization": f"Bearer {key}"})
    await http.post("/rl/end_session", headers={"Authorization": f"Bearer {key}"})
    failed = dict(saved[0], session_id="sess-failed", input_ids=[], loss_mask=[], logprobs=[], versions=[], failed=True)
    failed.pop("temperatures", None)  # a field some records lack
    run = tmp_path / "run"
    TrajectoryFiles(run / "trajectories").append(saved)
    TrajectoryFiles(run / "trajectories").append([failed])

    out = tmp_path / "export" / "records.parquet"
    cli = [sys.executable, "-m", "rlgate.cli", "trajectories", "export", str(run), "--out", str(out)]
    result = subprocess.run([*cli, "--model", "tiny-random"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "2 records" in result.stdout, result.stderr
    frame = pandas.read_parquet(out)
    [record] = saved
    row = frame.iloc[0]
    assert list(row["input_ids"]) == record["input_ids"] and list(row["loss_mask"]) == record["loss_mask"]
    assert list(row["logprobs"]) == pytest.approx(record["logprobs"], abs=0)  # float64: exact
    assert row["text"] == tiny_tokenizer.decode(record["input_ids"], skip_special_tokens=False)
    assert list(row["completions"]) == [
        tiny_tokenizer.decode(record["input_ids"][a:b], skip_special_tokens=False)
        for a, b in sampled_spans(record["loss_mask"])
    ]
    assert len(row["completions"]) == 2 and row["completions"][1].startswith(second.choices[0].message.content)
    assert bool(frame.iloc[1]["failed"]) and len(frame.iloc[1]["input_ids"]) == 0
    assert frame.iloc[1]["temperatures"] is None
    loaded = datasets.load_dataset("parquet", data_files=str(out), split="train")
    assert loaded[0]["input_ids"] == record["input_ids"] and loaded[0]["interaction_ids"] == record["interaction_ids"]

    lines = tmp_path / "records.jsonl"
    result = subprocess.run([*cli[:-2], "--out", str(lines), "--format", "jsonl"], capture_output=True, text=True)
    assert result.returncode == 2 and "pass --model" in result.stderr  # the run folder names no model
    (run / "config.toml").write_text('[model]\nname = "tiny-random"\n')
    result = subprocess.run([*cli[:-2], "--out", str(lines), "--format", "jsonl"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert [json.loads(line)["text"] for line in lines.read_text().splitlines()] == list(frame["text"])
