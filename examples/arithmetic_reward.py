"""The reward function of examples/arithmetic.jsonl (configs/dataset.toml).

rlgate calls it as ``reward(completion, row, messages)``: the reply's text, the
dataset row it answered and the prompt's chat messages. 1.0 when the reply's
first number is the row's answer, else 0.0.
"""

from __future__ import annotations

import re


def reward(completion: str, row: dict, messages: list[dict]) -> float:
    found = re.search(r"-?\d+", completion)
    return float(found is not None and found.group() == row["answer"])
