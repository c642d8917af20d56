"""``rlgate trajectories export``: a run's saved records as a dataset file people can read.

The records on disk hold token ids only (the hot path decodes nothing); an
export adds, for each record, ``text`` (its whole sequence decoded, special
tokens kept, so the chat template's structure shows) and ``completions`` (the
decoded text of each span the model sampled, in order). Parquet keeps every
list column as a list (``input_ids``, ``loss_mask``, ``logprobs``, ...), so
``pandas.read_parquet`` and ``datasets.load_dataset("parquet", ...)`` load it
as it was saved; JSON lines are the same records, one per line.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

from rlgate.logfile import json_lines

logger = logging.getLogger(__name__)

FORMATS = ("parquet", "jsonl")


def trajectory_folder(run: str | Path) -> Path:
    """The ``trajectories/`` folder of a run folder (or that folder itself)."""
    run = Path(run)
    folder = run if run.name == "trajectories" else run / "trajectories"
    if not any(folder.glob("part-*.jsonl")):
        raise ValueError(f"{run} holds no saved trajectories (no trajectories/part-*.jsonl)")
    return folder


def records(run: str | Path) -> Iterator[dict]:
    """The run's saved records, oldest first (a torn last line, a write in progress, is not read)."""

    def bad(line: str) -> None:
        logger.warning("skipped a line that is not a record: %.200s", line)

    for segment in sorted(trajectory_folder(run).glob("part-*.jsonl")):
        with open(segment, encoding="utf-8") as handle:
            for _, record in json_lines(handle, bad):
                yield record


def sampled_spans(loss_mask: list[int]) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of 1s in ``loss_mask``: the spans the model sampled."""
    spans, start = [], None
    for at, bit in enumerate([*loss_mask, 0]):
        if bit and start is None:
            start = at
        elif not bit and start is not None:
            spans.append((start, at))
            start = None
    return spans


def readable(record: dict, tokenizer) -> dict:
    """The record with ``text`` and ``completions`` decoded beside its token ids."""
    ids = record.get("input_ids") or []
    spans = sampled_spans(record.get("loss_mask") or [])
    return {
        **record,
        "text": tokenizer.decode(ids, skip_special_tokens=False),
        "completions": [tokenizer.decode(ids[a:b], skip_special_tokens=False) for a, b in spans],
    }


def export(run: str | Path, out: str | Path, fmt: str, tokenizer) -> int:
    """Write the run's records, made readable, to ``out`` as ``fmt``; returns how many."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    rows = [readable(record, tokenizer) for record in records(run)]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        with open(out, "w", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        return len(rows)
    import pyarrow as pa
    import pyarrow.parquet as pq

    # Columns are every field any record has (not only the first record's); null where a record lacks it.
    names = list(dict.fromkeys(name for row in rows for name in row))
    pq.write_table(pa.table({name: [row.get(name) for row in rows] for name in names}), out)
    return len(rows)


def run_model(run: str | Path) -> str | None:
    """The model a run was trained with, from the config.toml a training run leaves in its folder."""
    config = Path(run) / "config.toml"
    if Path(run).name == "trajectories":
        config = Path(run).parent / "config.toml"
    if not config.is_file():
        return None
    from rlgate.config import load_config

    return load_config(config).model.name
