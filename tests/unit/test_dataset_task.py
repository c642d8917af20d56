"""[task] dataset and reward: prompts from a file or the local Hugging Face cache,
scored by a user's function; what is wrong with either is said before a run starts."""

from __future__ import annotations

import json
import random

import pytest

from rlgate.config import ConfigError, parse_config
from rlgate.training.dataset_task import DatasetError, DatasetTask, dataset_task, load_function, load_rows
from tests.support import ROOT

ROWS = [
    {"prompt": "What is 1 + 2?", "answer": "3"},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}], "answer": "4"},
    {"prompt": "What is 5 + 5?", "answer": "10"},
]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + "\n")  # a blank last line is fine
    return str(path)


def test_jsonl_and_parquet_give_the_same_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    flat = [{"prompt": "a?", "answer": "1"}, {"prompt": "b?", "answer": "2"}]
    pq.write_table(pa.Table.from_pylist(flat), tmp_path / "rows.parquet")
    assert load_rows(write_jsonl(tmp_path / "rows.jsonl", flat)) == flat
    assert load_rows(str(tmp_path / "rows.parquet")) == flat


def test_a_dataset_in_the_local_hugging_face_cache_is_read_by_name(tmp_path, monkeypatch):
    """A dataset saved by `datasets` loads by its folder name, the split asked for."""
    datasets = pytest.importorskip("datasets", reason="datasets is a dev dependency")
    datasets.Dataset.from_list([{"prompt": "x?", "answer": "1"}]).to_parquet(str(tmp_path / "named" / "train.parquet"))
    monkeypatch.chdir(tmp_path)
    assert load_rows("named", "train") == [{"prompt": "x?", "answer": "1"}]
    with pytest.raises(DatasetError, match=r"named \(split 'test'\)"):
        load_rows("named", "test")


@pytest.mark.parametrize(
    ("contents", "message"),
    [
        ('{"prompt": "a"}\nnot json\n', r"rows.jsonl, line 2: not JSON"),
        ('["a list"]\n', r"line 1: a row is a JSON object"),
    ],
)
def test_a_broken_jsonl_file_names_the_line(tmp_path, contents, message):
    (tmp_path / "rows.jsonl").write_text(contents)
    with pytest.raises(DatasetError, match=message):
        load_rows(str(tmp_path / "rows.jsonl"))


def test_missing_files_and_other_formats_are_named(tmp_path):
    with pytest.raises(DatasetError, match="nope.jsonl: no such file"):
        load_rows(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DatasetError, match="nope.parquet: no such file"):
        load_rows(str(tmp_path / "nope.parquet"))
    (tmp_path / "rows.csv").write_text("prompt\na\n")
    with pytest.raises(DatasetError, match="a dataset file is .jsonl or .parquet"):
        load_rows(str(tmp_path / "rows.csv"))
    (tmp_path / "latin1.jsonl").write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(DatasetError, match="latin1.jsonl: not UTF-8 text"):
        load_rows(str(tmp_path / "latin1.jsonl"))
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DatasetError, match="broken.parquet: not a readable parquet file"):
        load_rows(str(tmp_path / "broken.parquet"))
    (tmp_path / "folder.jsonl").mkdir()
    with pytest.raises(DatasetError, match="folder.jsonl: a folder, not a .jsonl file"):
        load_rows(str(tmp_path / "folder.jsonl"))


def score(completion, row, messages):
    return completion.strip() == row["answer"]


def test_every_row_is_played_once_per_pass_in_a_seeded_order():
    def played(seed: int, rows: int) -> list[str]:
        task, rng = DatasetTask(ROWS, "prompt", score, "rows"), random.Random(seed)
        return [task.problem(rng).id for _ in range(rows)]

    passes = [played(5, 3 * len(ROWS))[i : i + len(ROWS)] for i in range(0, 3 * len(ROWS), len(ROWS))]
    assert all(sorted(p) == ["row-0", "row-1", "row-2"] for p in passes)
    assert played(5, 3 * len(ROWS)) == sum(passes, [])  # the same seed, the same order
    assert len({tuple(played(seed, len(ROWS))) for seed in range(20)}) > 1  # shuffled, not in file order


def test_prompts_become_chat_messages_and_the_reward_sees_the_row():
    seen = []

    def reward(completion, row, messages):
        seen.append((completion, row, messages))
        return completion.strip() == row["answer"]

    task = DatasetTask(ROWS, "prompt", reward, "rows")
    problems = {p.id: p for p in (task.problem(random.Random(0)) for _ in ROWS)}
    text, chat = problems["row-0"], problems["row-1"]
    assert text.messages == [{"role": "user", "content": "What is 1 + 2?"}]
    assert chat.messages == ROWS[1]["prompt"] and chat.messages is not ROWS[1]["prompt"]
    assert task.reward(text, " 3") == 1.0 and task.reward(chat, "5") == 0.0  # a bool counts as 1 or 0
    assert seen[0] == (" 3", ROWS[0], text.messages)


def test_a_reward_that_is_not_a_finite_number_fails_the_episode_with_why():
    import numpy as np

    def task(value) -> DatasetTask:
        return DatasetTask(ROWS, "prompt", lambda completion, row, messages: value, "rows")

    problem = task(0).problem(random.Random(0))
    assert task(np.float32(0.25)).reward(problem, "3") == 0.25 and task(np.bool_(True)).reward(problem, "3") == 1.0
    with pytest.raises(TypeError, match="returned str, not a number"):
        task("1.0").reward(problem, "3")
    with pytest.raises(TypeError, match="returned NoneType, not a number"):
        task(None).reward(problem, "3")
    with pytest.raises(ValueError, match="the reward function returned nan"):
        task(float("nan")).reward(problem, "3")


def test_a_missing_column_or_an_unusable_prompt_is_said_at_the_start():
    with pytest.raises(
        DatasetError, match=r"rows: no column 'question' \(set \[task\] prompt_column\); columns: prompt"
    ):
        DatasetTask(ROWS, "question", score, "rows")
    with pytest.raises(DatasetError, match=r"rows row 1: a prompt is text or a list of \{role, content\} messages"):
        DatasetTask([{"prompt": "fine"}, {"prompt": 42}], "prompt", score, "rows")
    with pytest.raises(DatasetError, match="rows: no rows"):
        DatasetTask([], "prompt", score, "rows")


def test_reward_functions_load_from_a_module_or_a_file(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def exact(completion, row, messages):\n    return 1.0\nvalue = 3\n")
    monkeypatch.chdir(tmp_path)  # a module beside the config is found from the working directory
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_function("my_rewards:exact")("", {}, []) == 1.0
    assert load_function(f"{tmp_path / 'my_rewards.py'}:exact")("", {}, []) == 1.0
    with pytest.raises(DatasetError, match="my_rewards has no function 'value'"):
        load_function("my_rewards:value")
    with pytest.raises(DatasetError, match=r"no module 'no_such_rewards' \(run from its folder"):
        load_function("no_such_rewards:exact")
    with pytest.raises(DatasetError, match="no such file"):
        load_function(f"{tmp_path / 'absent.py'}:exact")
    (tmp_path / "needs.py").write_text("import not_installed_anywhere\n")  # the module is found, its import is not
    with pytest.raises(DatasetError, match="needs:f: needs failed to import: No module named 'not_installed_anywhere'"):
        load_function("needs:f")
    (tmp_path / "typed.py").write_text(  # a dataclass needs its module in sys.modules, as an import would have it
        "from dataclasses import dataclass\n@dataclass\nclass Score:\n    value: float\n"
        "def score(completion, row, messages):\n    return Score(1.0).value\n"
    )
    assert load_function(f"{tmp_path / 'typed.py'}:score")("", {}, []) == 1.0
    (tmp_path / "broken.py").write_text("raise RuntimeError('no luck')\n")
    with pytest.raises(DatasetError, match="broken.py failed to load: RuntimeError: no luck"):
        load_function(f"{tmp_path / 'broken.py'}:exact")


def test_the_shipped_example_loads_and_scores():
    from rlgate.config import load_config

    task = load_config(ROOT / "configs" / "dataset.toml").task
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(ROOT)  # the config's paths are from the checkout, where `rlgate train` runs
        loaded = dataset_task(task.dataset, task.dataset_split, task.prompt_column, task.reward)
    problem = loaded.problem(random.Random(0))
    assert len(loaded.rows) == 64 and problem.messages[0]["content"].startswith("What is ")
    assert loaded.reward(problem, f"{problem.row['answer']}.") == 1.0 and loaded.reward(problem, "I don't know") == 0.0


@pytest.mark.parametrize(
    ("task", "message"),
    [
        ({"dataset": "rows.jsonl"}, r"\[task\] dataset and \[task\] reward go together"),
        ({"reward": "m:f"}, r"\[task\] dataset and \[task\] reward go together"),
        ({"dataset": "rows.jsonl", "reward": "m:f", "builtin": "vowels"}, r"set one of \[task\] builtin and"),
        ({"dataset": "rows.jsonl", "reward": "just-a-module"}, r"task.reward: String should match pattern"),
    ],
)
def test_config_says_what_a_dataset_needs(task, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"task": task})


def test_a_dataset_and_a_task_app_are_one_too_many():
    settings = {"task": {"dataset": "rows.jsonl", "reward": "m:f"}, "services": {"task_url": "http://127.0.0.1:9"}}
    with pytest.raises(ConfigError, match=r"set one of \[task\] dataset and \[services\] task_url"):
        parse_config(settings)


def test_each_group_has_its_own_task_id_when_a_row_comes_again():
    """Groups are made of sessions with one task id: two groups of the same row
    in flight at once (a new pass starting, or a resumed run) must not mix."""
    from rlgate.training.tasks import builtin_episodes

    def ids(count: int) -> list[str]:
        groups, _ = builtin_episodes(DatasetTask(ROWS[:1], "prompt", score, "rows"), "http://127.0.0.1:9")
        return [next(groups)[0] for _ in range(count)]

    first, resumed = ids(3), ids(3)
    assert len(set(first)) == 3 and all(i.startswith("row-0.") for i in first)
    assert not set(first) & set(resumed)  # a resumed run's groups never join the earlier run's open ones
