"""Held-out evaluation without a gateway: pass@k, the report's figures and
table, seeds as problems, the driver's evaluation beside its step loop, and
``rlgate eval``'s arguments."""

from __future__ import annotations

import argparse
import json
import threading

import pytest

from rlgate.cli.evaluate import configured, seeds_of, serve_model_of
from rlgate.config import parse_config
from rlgate.training.dataset_task import DatasetTask
from rlgate.training.evaluation import EvalReport, Evaluator, SeedResult, pass_at_k, problems_for
from rlgate.training.tasks import get_task


def test_pass_at_k_is_the_unbiased_estimate():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25) and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)  # 1 - C(2,2)/C(4,2)
    assert pass_at_k(10, 3, 3) == pytest.approx(1 - 35 / 120)
    with pytest.raises(ValueError, match="k must be in 1..4"):
        pass_at_k(4, 1, 5)


def test_a_report_gives_mean_reward_and_pass_at_k_per_seed_and_over_all():
    report = EvalReport(
        [SeedResult(7, [1.0, 0.0, 0.0, 1.0]), SeedResult(8, [0.5, 0.5, 0.5, 0.5]), SeedResult(9, [1.0], failed=3)],
        n=4,
        threshold=1.0,
    )
    assert report.episodes == 9 and report.failed == 3
    assert report.mean_reward == pytest.approx(5.0 / 9)
    # seed 9's failed episodes are neither passes nor misses: its pass@1 is from the one that ran,
    # and it has no pass@2 or pass@4
    assert report.pass_at(1) == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert report.pass_at(4) == pytest.approx((1.0 + 0.0) / 2)
    whole = report.as_dict()
    assert whole["pass_at"] == {"1": pytest.approx(0.5), "2": pytest.approx((5 / 6) / 2), "4": pytest.approx(0.5)}
    assert [s["passes"] for s in whole["seeds"]] == [2, 0, 1]
    assert whole["seeds"][2]["pass_at"] == {"1": 1.0, "2": None, "4": None}
    assert json.loads(json.dumps(whole)) == whole
    metrics = report.metrics()
    assert metrics["eval_reward_mean"] == pytest.approx(5.0 / 9) and metrics["eval_pass_at_4"] == pytest.approx(0.5)
    from rich.console import Console

    console = Console(width=120, record=True)
    console.print(report.table())
    text = console.export_text()
    assert "pass@4" in text and "2/4" in text and "1/4 (3 failed)" in text


def test_a_seed_names_a_rows_problem_or_a_built_in_tasks_draw():
    rows = [{"prompt": f"q{i}"} for i in range(5)]
    dataset = DatasetTask(rows, "prompt", lambda completion, row, messages: 1.0, "rows.jsonl")
    items = problems_for(dataset, [4, 0])
    assert [(seed, p.id, p.messages[0]["content"]) for seed, p in items] == [(4, "row-4", "q4"), (0, "row-0", "q0")]
    with pytest.raises(ValueError, match=r"seeds name rows of the dataset: 0..4 \(got \[5\]\)"):
        problems_for(dataset, [5])
    arithmetic = get_task("arithmetic")
    first, again = problems_for(arithmetic, [3, 11]), problems_for(arithmetic, [3, 11])
    assert [p.id for _, p in first] == [p.id for _, p in again]  # the same seed, the same problem
    assert first[0][1].id != first[1][1].id


def test_the_drivers_evaluation_runs_beside_its_steps():
    """A step that makes an evaluation due does not wait for it; its figures join
    the first step logged after it finished; one runs at a time."""
    release, started = threading.Event(), []

    def slow(step: int) -> EvalReport:
        started.append(step)
        release.wait(10)
        return EvalReport([SeedResult(1, [1.0])], n=1, threshold=1.0)

    evaluator = Evaluator(slow, due=lambda step: step % 2 == 0)
    assert evaluator.at(1) == {} and started == []
    assert evaluator.at(2) == {}  # started, not waited for
    assert evaluator.at(4) == {} and started == [2]  # due again, but one is under way: not a second
    release.set()
    evaluator._thread.join(10)
    figures = evaluator.at(5)
    assert figures["eval_step"] == 2 and figures["eval_reward_mean"] == 1.0 and figures["eval_pass_at_1"] == 1.0
    assert evaluator.at(5) == {}  # handed over once

    def broken(step: int):
        raise ConnectionError("gateway down")

    failing = Evaluator(broken, due=lambda step: True)
    figures = failing.at(1) or failing.wait(10)  # it may have failed before at() looked
    assert figures == {"eval_reward_mean": None, "eval_episodes": 0, "eval_step": 1}


def test_rlgate_eval_takes_its_episodes_and_model_from_flags_over_the_config(tmp_path, tiny_path):
    config_file = tmp_path / "c.toml"
    config_file.write_text('[task]\nbuiltin = "vowels"\n[evaluation]\nseeds = [1, 2]\n')
    flags = dict(config=str(config_file), task=None, dataset=None, reward=None, task_app=None)
    flags.update(seeds=None, n=None, threshold=None)
    config = configured(argparse.Namespace(**flags))
    assert config.evaluation.seeds == [1, 2] and config.evaluation.n == 1 and config.task.builtin == "vowels"
    config = configured(argparse.Namespace(**{**flags, "task": "arithmetic", "seeds": ["0-2", "9"], "n": 4}))
    assert config.task.builtin == "arithmetic" and config.evaluation.seeds == [0, 1, 2, 9] and config.evaluation.n == 4
    with pytest.raises(ValueError, match="--dataset needs --reward"):
        configured(argparse.Namespace(**{**flags, "dataset": "rows.jsonl"}))
    config = configured(argparse.Namespace(**{**flags, "dataset": "rows.jsonl", "reward": "m:f"}))
    assert (config.task.builtin, config.task.dataset, config.task.reward) == (None, "rows.jsonl", "m:f")
    config_file.write_text('[task]\ndataset = "rows.jsonl"\nreward = "m:f"\n[evaluation]\nseeds = [1]\n')
    config = configured(argparse.Namespace(**{**flags, "task": "vowels"}))  # one source replaces another
    assert (config.task.builtin, config.task.dataset, config.task.reward) == ("vowels", None, None)
    config = configured(argparse.Namespace(**{**flags, "task_app": "http://127.0.0.1:9000"}))
    assert config.services.task_url == "http://127.0.0.1:9000" and config.task.dataset is None
    with pytest.raises(ValueError, match="--threshold: evaluation.pass_threshold"):
        configured(argparse.Namespace(**{**flags, "threshold": float("nan")}))
    config_file.write_text("[task]\nseeds = [0, 1]\n[evaluation]\nevery_n_iters = 5\nseeds = [7]\n")
    config = configured(argparse.Namespace(**{**flags, "task_app": "http://127.0.0.1:9000", "seeds": ["0-3"]}))
    assert config.evaluation.seeds == [0, 1, 2, 3]  # the training seeds may be evaluated: nothing trains here
    config_file.write_text('[task]\nbuiltin = "vowels"\n')
    with pytest.raises(ValueError, match="no seeds to evaluate: give --seeds"):
        configured(argparse.Namespace(**flags))
    with pytest.raises(ValueError, match="--seeds takes numbers and ranges like 0-31, not 'x'"):
        seeds_of(["x"])

    served = parse_config({})
    assert serve_model_of(served, "tiny-random") == "tiny-random" and served.model.name == "tiny-random"
    from rlgate import run as runs

    run = tmp_path / "run"
    checkpoint = runs.checkpoints_dir(run) / runs.checkpoint_name(6)
    (checkpoint / runs.ADAPTER).mkdir(parents=True)
    (checkpoint / runs.STATE_FILE).write_text(json.dumps({"version": 6, "next_command": 6, "driver": {"step": 6}}))
    (run / "config.toml").write_text('[model]\nname = "tiny-random"\n')
    served = parse_config({})
    assert serve_model_of(served, str(run)) == f"{run} step 6: tiny-random with its LoRA adapter"
    assert served.model.name == "tiny-random" and served.model.adapter == str(checkpoint / runs.ADAPTER)


def test_a_datasets_evaluation_rows_are_held_out_of_training():
    import random

    from rlgate.training.dataset_task import DatasetError

    rows = [{"prompt": f"q{i}"} for i in range(6)]
    dataset = DatasetTask(rows, "prompt", lambda completion, row, messages: 1.0, "rows.jsonl")
    dataset.hold_out([1, 4])
    rng = random.Random(0)
    trained = {dataset.problem(rng).id for _ in range(3 * 4)}  # three passes over what is left
    assert trained == {"row-0", "row-2", "row-3", "row-5"}
    assert problems_for(dataset, [1, 4])[0][1].id == "row-1"  # still there to evaluate
    with pytest.raises(DatasetError, match=r"\[evaluation\] seeds name rows 0..5 \(got \[6\]\)"):
        dataset.hold_out([6])
    with pytest.raises(DatasetError, match="hold out every row; none is left to train on"):
        dataset.hold_out(list(range(6)))


def test_rlgate_eval_may_evaluate_every_row_the_training_run_holds_out(tmp_path):
    """A training config's [evaluation] seeds hold rows out of training; `rlgate eval`
    loads the same dataset whole, so it may evaluate every row."""
    from rlgate.training.driver import load_dataset_task

    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(3)))
    (tmp_path / "score.py").write_text("def reward(completion, row, messages):\n    return 1.0\n")
    task = {"dataset": str(tmp_path / "rows.jsonl"), "reward": f"{tmp_path / 'score.py'}:reward"}
    config = parse_config({"task": task, "evaluation": {"every_n_iters": 1, "seeds": [0, 1]}})
    assert load_dataset_task(config).held_out == {0, 1}
    config.evaluation.seeds = [0, 1, 2]
    with pytest.raises(SystemExit, match="hold out every row"):
        load_dataset_task(config)
    assert load_dataset_task(config, training=False).held_out == set()


def test_an_end_that_fails_costs_its_episode_nothing_and_a_seed_given_twice_is_reported_once(monkeypatch):
    """An evaluation whose end_session call broke (the gateway dropped the
    connection) lost the whole report; a seed listed twice was reported twice,
    its episodes counted twice over."""
    import asyncio

    import httpx

    from rlgate.training.evaluation import evaluate

    ends = []

    async def post(self, url, **kwargs):  # the gateway, as the evaluation's client reaches it
        request = httpx.Request("POST", url)
        if url.endswith("/rl/start_session"):
            return httpx.Response(200, json={"session_id": "s", "api_key": "rlg-k"}, request=request)
        ends.append(url)
        raise httpx.RemoteProtocolError("the server closed the connection", request=request)

    async def play(session, item):
        return 1.0

    monkeypatch.setattr(httpx.AsyncClient, "post", post)
    report = asyncio.run(evaluate("http://gateway", "admin", play, [(0, "a"), (1, "b"), (0, "a")], 2, 4, 1.0))
    # seed 0 listed twice (synth-ai's instances cycle the seeds): played 2n times, reported once
    assert [seed.seed for seed in report.seeds] == [0, 1] and report.episodes == 6
    assert [len(seed.rewards) for seed in report.seeds] == [4, 2] and len(ends) == 6


def test_rlgate_eval_fails_when_no_episode_could_be_scored(tmp_path, capsys, monkeypatch):
    """An unreachable gateway or a wrong key made every episode fail, and eval still
    exited 0: a CI job would read that as a pass."""
    from rlgate.cli.main import main

    monkeypatch.delenv("RLGATE_URL", raising=False)
    config = tmp_path / "c.toml"
    config.write_text('[task]\nbuiltin = "vowels"\n')
    code = main(
        ["eval", "--config", str(config), "--backend", "http://127.0.0.1:9", "--api-key", "k", "--seeds", "0-1"]
    )
    assert code == 1 and "every one of 2 episodes failed" in capsys.readouterr().err
