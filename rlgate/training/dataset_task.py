"""Prompts from a dataset and a reward function, played as a built-in task.

What users coming from TRL or verl try first: ``[task] dataset`` (a ``.jsonl``
or ``.parquet`` file, or a dataset name ``datasets.load_dataset`` knows) with a
prompt column, and ``[task] reward = "module:function"`` (or
``"file.py:function"``), called as ``function(completion, row, messages)`` with
the reply's text, the dataset row (a dict) and the prompt's chat messages. The
driver's agent loop plays each prompt through the gateway as any session (one
GRPO group per prompt), so the episodes are recorded, admitted and trained like
any other. Rows come in a seeded random order, every row once per pass.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlgate.training.tasks import Problem


class DatasetError(ValueError):
    """A dataset or reward function that cannot be used; the message says why."""


class DatasetTask:
    """A task over dataset rows (see the module's docstring)."""

    name = "dataset"

    def __init__(self, rows: list[dict], prompt_column: str, reward: Callable[..., Any], source: str) -> None:
        if not rows:
            raise DatasetError(f"{source}: no rows")
        if prompt_column not in rows[0]:
            raise DatasetError(
                f"{source}: no column {prompt_column!r} (set [task] prompt_column); columns: {', '.join(rows[0])}"
            )
        self.rows, self.prompt_column, self.score, self.source = rows, prompt_column, reward, source
        self._order: list[int] = []
        self.held_out: set[int] = set()
        for index, row in enumerate(rows):
            messages_of(row.get(prompt_column), f"{source} row {index}")  # every prompt usable, said at start

    def problem(self, rng: random.Random) -> Problem:
        if not self._order:  # a new pass over the rows
            self._order = [index for index in range(len(self.rows)) if index not in self.held_out]
            rng.shuffle(self._order)
        return self.problem_at(self._order.pop())

    def hold_out(self, rows: list[int]) -> None:
        """Keep ``rows`` (evaluation seeds) out of training."""
        wrong = [row for row in rows if not 0 <= row < len(self.rows)]
        if wrong:
            raise DatasetError(f"{self.source}: [evaluation] seeds name rows 0..{len(self.rows) - 1} (got {wrong[:3]})")
        if len(set(rows)) >= len(self.rows):
            raise DatasetError(f"{self.source}: [evaluation] seeds hold out every row; none is left to train on")
        self.held_out, self._order = set(rows), []

    def problem_at(self, index: int) -> Problem:
        """Row ``index`` as a problem (an evaluation seed names a row)."""
        row = self.rows[index]
        messages = messages_of(row[self.prompt_column], f"{self.source} row {index}")
        return Problem(f"row-{index}", messages, row=row)

    def reward(self, problem: Problem, reply: str) -> float:
        value = self.score(reply, problem.row, problem.messages)
        try:  # a bool, int, float, or numpy / torch scalar; not text
            number = float(value) if not isinstance(value, str | bytes) else None
        except (TypeError, ValueError):
            number = None
        if number is None:
            raise TypeError(f"the reward function returned {type(value).__name__}, not a number")
        if not math.isfinite(number):
            raise ValueError(f"the reward function returned {number}")
        return number


def messages_of(prompt: Any, where: str) -> list[dict]:
    """A prompt as chat messages: text is one user message; a list of
    ``{"role", "content"}`` mappings is taken as it is (the conversational format)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in prompt)
    ):
        return [dict(m) for m in prompt]
    raise DatasetError(f"{where}: a prompt is text or a list of {{role, content}} messages, not {prompt!r:.80}")


def load_rows(source: str, split: str = "train") -> list[dict]:
    """The rows of a ``.jsonl`` / ``.parquet`` file, or of a dataset by name: a
    folder, or a Hub name, read by ``datasets`` from its cache, or downloaded when the Hub is reachable)."""
    path = Path(source)
    if path.suffix in (".jsonl", ".parquet") and path.is_dir():
        raise DatasetError(f"{source}: a folder, not a {path.suffix} file")
    if path.suffix == ".jsonl":
        return _jsonl(path)
    if path.suffix == ".parquet":
        if not path.is_file():
            raise DatasetError(f"{source}: no such file")
        import pyarrow
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except (pyarrow.ArrowException, OSError) as err:
            raise DatasetError(f"{source}: not a readable parquet file ({err})") from None
    if path.is_file():
        raise DatasetError(f"{source}: a dataset file is .jsonl or .parquet")
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"{source}: reading a dataset by name needs the `datasets` package") from None
    try:
        return datasets.load_dataset(source, split=split).to_list()
    except Exception as err:  # datasets raises many kinds; its message says which
        raise DatasetError(f"{source} (split {split!r}): {err.__class__.__name__}: {err}") from None


def _jsonl(path: Path) -> list[dict]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DatasetError(f"{path}: no such file") from None
    except UnicodeDecodeError as err:
        raise DatasetError(f"{path}: not UTF-8 text (byte {err.start})") from None
    except OSError as err:
        raise DatasetError(f"{path}: cannot be read ({err.strerror})") from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DatasetError(f"{path}, line {number}: not JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise DatasetError(f"{path}, line {number}: a row is a JSON object")
        rows.append(row)
    return rows


def load_function(spec: str) -> Callable[..., Any]:
    """``module:function`` (importable, or from the working directory) or ``file.py:function``."""
    where, _, name = spec.rpartition(":")
    if where.endswith(".py"):
        path = Path(where).resolve()
        if not path.is_file():
            raise DatasetError(f"{spec}: no such file {where}")
        module_name = f"rlgate_reward_{path.stem}"
        found = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(found)
        sys.modules[module_name] = module  # as an import would: dataclasses and pickling look it up there
        if str(path.parent) not in sys.path:
            sys.path.append(str(path.parent))  # its own imports of files beside it
        try:
            found.loader.exec_module(module)
        except Exception as err:
            del sys.modules[module_name]
            raise DatasetError(f"{spec}: {where} failed to load: {err.__class__.__name__}: {err}") from None
    else:
        if str(Path.cwd()) not in sys.path and "" not in sys.path:
            sys.path.append(str(Path.cwd()))  # a module beside the config, as `python -m` would find it
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as err:
            if err.name is not None and (where == err.name or where.startswith(err.name + ".")):
                hint = "run from its folder, or give file.py:function"
                raise DatasetError(f"{spec}: no module {err.name!r} ({hint})") from None
            raise DatasetError(f"{spec}: {where} failed to import: {err}") from None
        except Exception as err:
            raise DatasetError(f"{spec}: {where} failed to import: {err.__class__.__name__}: {err}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise DatasetError(f"{spec}: {where} has no function {name!r}")
    return function


def dataset_task(dataset: str, split: str, prompt_column: str, reward: str) -> DatasetTask:
    """The ``[task] dataset`` task, loaded and checked (DatasetError says what is wrong)."""
    return DatasetTask(load_rows(dataset, split), prompt_column, load_function(reward), dataset)
