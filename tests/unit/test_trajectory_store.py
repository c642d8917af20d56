"""TrajectoryFiles: append-only JSON-lines segments, read in order, sessions never split."""

from __future__ import annotations

import json

import pytest

from rlgate.sessions.trajectory_files import TrajectoryFiles
from tests.support import Disk


def session(name: str, n: int) -> list[dict]:
    return [{"session_id": name, "turn": i} for i in range(n)]


def test_records_come_back_in_order_with_sequence_numbers(tmp_path):
    files = TrajectoryFiles(tmp_path)
    assert files.append(session("a", 2)) == [1, 2]
    assert files.append(session("b", 1)) == [3]
    assert [(r["seq"], r["session_id"]) for r in files.read(0, 100)] == [(1, "a"), (2, "a"), (3, "b")]
    assert [r["seq"] for r in files.read(2, 100)] == [3]
    assert files.read(3, 100) == []


def test_a_limit_never_splits_a_session(tmp_path):
    files = TrajectoryFiles(tmp_path)
    files.append(session("a", 3))
    files.append(session("b", 2))
    # limit 2 falls inside session a: its third record comes too, b waits for the next read
    assert [r["seq"] for r in files.read(0, 2)] == [1, 2, 3]
    assert [r["seq"] for r in files.read(3, 1)] == [4, 5]


def test_an_append_in_progress_is_not_read(tmp_path):
    files = TrajectoryFiles(tmp_path)
    files.append(session("a", 1))
    # another writer's lines are on disk, but its append has not returned (last_seq unchanged)
    [segment] = files.segments()
    with open(segment, "a") as handle:
        handle.write(json.dumps({"seq": 2, "session_id": "b"}) + "\n")
    assert [r["seq"] for r in files.read(0, 100)] == [1]
    files.last_seq = 2  # the append finished
    assert [r["seq"] for r in files.read(0, 100)] == [1, 2]


def test_segments_roll_over_and_a_torn_line_is_cut_on_recovery(tmp_path):
    files = TrajectoryFiles(tmp_path, segment_bytes=64)
    for name in "abcd":
        files.append(session(name, 2))
    assert len(files.segments()) > 1
    assert [r["seq"] for r in files.read(0, 100)] == list(range(1, 9))
    assert [r["seq"] for r in files.read(5, 100)] == [6, 7, 8]
    with open(files.segments()[-1], "a") as handle:
        handle.write('{"seq": 9, "session_id": "torn"')  # a crash mid-write
    again = TrajectoryFiles(tmp_path, segment_bytes=64)
    assert again.last_seq == 8 and again.append(session("e", 1)) == [9]
    assert [r["session_id"] for r in again.read(8, 100)] == ["e"]


def test_last_seq_reads_the_log_without_touching_it(tmp_path):
    from rlgate.sessions.trajectory_files import last_seq

    assert last_seq(tmp_path / "none") == 0
    files = TrajectoryFiles(tmp_path, segment_bytes=200)
    files.append([{"reward": float(i), "pad": "x" * 80} for i in range(5)])
    segment = files.segments()[-1]
    with open(segment, "ab") as handle:
        handle.write(b'{"seq": 6, "reward": 1')  # a write in progress
    before = segment.read_bytes()
    assert last_seq(tmp_path) == 5 and segment.read_bytes() == before


def test_a_session_saved_twice_is_kept_once(tmp_path):
    files = TrajectoryFiles(tmp_path)
    export = [{"session_id": "sess-1", "reward": 1.0}, {"session_id": "sess-1", "reward": 0.5}]
    assert files.append(export) == [1, 2]
    assert files.append(export) == []  # the store crashed after saving it and ends it again
    assert TrajectoryFiles(tmp_path).append(export) == []  # across a restart of the log too
    assert files.append([{"session_id": "sess-2", "reward": 0.0}]) == [3]
    assert [r["seq"] for r in files.read(0, 100)] == [1, 2, 3]


def test_last_seq_looks_past_a_segment_with_nothing_complete(tmp_path):
    from rlgate.sessions.trajectory_files import last_seq

    files = TrajectoryFiles(tmp_path)
    files.append([{"session_id": "a"}, {"session_id": "a"}])
    (tmp_path / "part-000000000003.jsonl").write_bytes(b'{"seq": 3, "sess')  # rolled over, then torn
    assert last_seq(tmp_path) == 2
    (tmp_path / "part-000000000003.jsonl").write_bytes(b"")
    assert last_seq(tmp_path) == 2


def test_text_python_can_hold_is_saved(tmp_path):
    files = TrajectoryFiles(tmp_path)
    assert files.append([{"session_id": "s", "task_id": "lone \ud800 surrogate", "text": "naïve ☃"}]) == [1]
    [record] = files.read(0, 10)
    assert record["task_id"] == "lone \ud800 surrogate" and record["text"] == "naïve ☃"


def test_a_write_that_fails_part_way_leaves_no_fragment(tmp_path):
    files = TrajectoryFiles(tmp_path)
    files.append(session("a", 1))
    before = files.segments()[-1].read_bytes()
    disk = Disk(room=20)  # part of b's first line fits, then the disk is full
    files.opener = disk.open
    with pytest.raises(OSError, match="No space"):
        files.append(session("b", 2))
    assert files.segments()[-1].read_bytes() == before and files.last_seq == 1
    disk.room = None  # space again: the retried save goes in whole, and everything reads
    assert files.append(session("b", 2)) == [2, 3]
    assert [r["session_id"] for r in files.read(0, 100)] == ["a", "b", "b"] and files.bad_lines == 0
    assert TrajectoryFiles(tmp_path).last_seq == 3


def test_a_fragment_left_behind_is_cut_before_the_next_append(tmp_path):
    files = TrajectoryFiles(tmp_path)
    files.append(session("a", 1))
    with open(files.segments()[-1], "ab") as handle:
        handle.write(b'{"seq": 2, "session_id": "b", "tu')  # a cut that failed too
    assert files.append(session("c", 1)) == [2]
    assert [r["session_id"] for r in files.read(0, 100)] == ["a", "c"] and files.bad_lines == 0


def test_a_line_that_is_not_a_record_is_skipped_and_counted(tmp_path):
    from rlgate.sessions.trajectory_files import last_seq

    files = TrajectoryFiles(tmp_path)
    files.append(session("a", 1))
    with open(files.segments()[-1], "ab") as handle:
        handle.write(b'{"seq": 2, "session_id": "b"{"seq": 2, "session_id": "c"}\n[1, 2]\n')  # merged lines
    files.append(session("d", 1))
    assert [r["session_id"] for r in files.read(0, 100)] == ["a", "d"] and files.bad_lines == 2
    assert last_seq(tmp_path) == 2 and TrajectoryFiles(tmp_path).last_seq == 2


def test_a_session_is_saved_once_whichever_segment_holds_it(tmp_path):
    import sqlite3

    files = TrajectoryFiles(tmp_path, segment_bytes=64)
    for name in "abcd":
        files.append(session(name, 2))
    assert len(files.segments()) > 2
    assert files.append(session("a", 2)) == []  # saved in the first segment
    assert TrajectoryFiles(tmp_path, segment_bytes=64).append(session("a", 2)) == []  # and after a restart
    # the index is a cache of the log: behind it (a crash between a segment's fsync and the
    # index's commit), it catches up; damaged, it is rebuilt from the segments
    index = tmp_path / "sessions.sqlite"
    with sqlite3.connect(index) as db:
        db.execute("DELETE FROM saved WHERE seq > 2")
    assert TrajectoryFiles(tmp_path, segment_bytes=64).append(session("d", 2)) == []
    for path in tmp_path.glob("sessions.sqlite*"):
        path.unlink()
    index.write_bytes(b"not a database " * 1000)
    again = TrajectoryFiles(tmp_path, segment_bytes=64)
    assert again.append(session("b", 2)) == [] and again.append(session("e", 1)) == [9]


def test_a_read_is_bounded_by_bytes_but_never_splits_a_session(tmp_path):
    files = TrajectoryFiles(tmp_path)
    for name in "abc":
        files.append([{"session_id": name, "pad": "x" * 1000}] * 2)
    # ~1 KiB a record: 2.5 KiB lets a in, and b would split, so b waits
    assert [r["session_id"] for r in files.read(0, 100, max_bytes=2500)] == ["a", "a"]
    assert [r["session_id"] for r in files.read(0, 100, max_bytes=100)] == ["a", "a"]  # one session at least
    assert len(files.read(0, 100, max_bytes=10_000)) == 6


def test_a_log_line_keeps_every_float_exactly_and_any_text():
    """The logs' lines come from pydantic-core's encoder: logprobs read back bit
    for bit (the trainer's importance ratios depend on them), infinities and NaN
    as Python's json writes them, and text it refuses (a lone surrogate) through
    json instead."""
    import json
    import math
    import random

    from rlgate.logfile import json_line

    rng = random.Random(3)
    floats = [-rng.random() * 30 for _ in range(2000)] + [5e-324, 1e308, -0.0, 0.1 + 0.2, -1e-7]
    entry = {"logprobs": floats, "ids": list(range(100)), "text": "é ☃ \U0001f600", "n": None, "ok": True}
    line = json_line(entry)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    back = json.loads(line)
    assert back == entry and all(a.hex() == b.hex() for a, b in zip(back["logprobs"], floats))
    special = json.loads(json_line({"low": -math.inf, "high": math.inf, "nan": math.nan}))
    assert special["low"] == -math.inf and special["high"] == math.inf and math.isnan(special["nan"])
    lone = json_line({"text": "a\ud800b"})
    assert json.loads(lone) == {"text": "a\ud800b"} and lone.isascii()
