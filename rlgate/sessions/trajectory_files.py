"""The trajectory log's file format: append-only JSON-lines segments under a
run's ``trajectories/`` folder, each record a saved session's sample with its
sequence number (``seq``), and an index of the sessions it holds.

Pure file logic, no Ray: :class:`TrajectoryFiles` is what the TrajectoryStore
actor (``actors/trajectory_store.py``) wraps, and what the driver
(:func:`last_seq`) and ``rlgate trajectories export`` read.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path

from rlgate.logfile import append_whole, cut_torn_tail, json_line, json_lines, open_log
from rlgate.sessions.trajectory import TrajectoryRecord

logger = logging.getLogger(__name__)

SEGMENT_BYTES = 64 * 2**20
READ_BYTES = 32 * 2**20  # most bytes of records one read returns (a session larger than that comes alone)


def last_seq(folder: str | Path) -> int:
    """The last sequence number written under ``folder`` (0 if none), read without
    touching the files (a store may be writing them)."""
    for segment in reversed(sorted(Path(folder).glob("part-*.jsonl"))):
        if seq := _tail_seq(segment.read_bytes()):
            return seq
    return 0


def _tail_seq(data: bytes) -> int:
    """The seq of the last whole record in a segment's bytes (0 if none)."""
    lines = data[: data.rfind(b"\n") + 1].splitlines()
    for line in reversed(lines):
        try:
            seq = json.loads(line).get("seq")
        except (ValueError, AttributeError):
            continue
        if isinstance(seq, int):
            return seq
    return 0


class SavedSessions:
    """Which sessions the log holds (session id -> the seq of its last record), in
    SQLite beside the segments, so a session is saved once however long ago its
    first save was. A cache of the log: records it does not cover yet (a crash
    between a segment's fsync and the index's commit) are added from the
    segments when the log opens, and an unreadable index is rebuilt from them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.db = self._open()
        except sqlite3.DatabaseError:
            logger.warning("session index %s unreadable; rebuilding it from the segments", path)
            for stale in path.parent.glob(path.name + "*"):
                stale.unlink()
            self.db = self._open()

    def _open(self) -> sqlite3.Connection:
        # Called from the store's worker threads, one at a time (the store's lock).
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=OFF")  # the segments are the durable copy
        db.execute("CREATE TABLE IF NOT EXISTS saved (session_id TEXT PRIMARY KEY, seq INTEGER NOT NULL)")
        db.execute("SELECT count(*) FROM saved").fetchone()  # reads every page header: a damaged file raises here
        return db

    def covered(self) -> int:
        return self.db.execute("SELECT coalesce(max(seq), 0) FROM saved").fetchone()[0]

    def holds(self, session_id: str) -> bool:
        return self.db.execute("SELECT 1 FROM saved WHERE session_id = ?", (session_id,)).fetchone() is not None

    def add(self, records: list[TrajectoryRecord]) -> None:
        rows = {r["session_id"]: r["seq"] for r in records if r.get("session_id") is not None}
        with self.db:
            self.db.executemany("INSERT OR REPLACE INTO saved VALUES (?, ?)", rows.items())


class TrajectoryFiles:
    """The on-disk log: ``part-<first seq>.jsonl`` files, one JSON record per line,
    each with a ``seq`` (1, 2, ...). Appends are whole or not at all
    (:func:`rlgate.logfile.append_whole`: a failed write is cut back) and
    fsync'd; readers skip, and count in ``bad_lines``, a line that is not a record.

    A session is saved once: an export of a session the log already holds (a
    SessionStore that crashed after saving it, before noting so, ends it again)
    is skipped, whichever segment holds it (:class:`SavedSessions`)."""

    def __init__(self, folder: str | Path, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = segment_bytes
        self.bad_lines = 0
        self.opener = open  # how segments are opened for appends (a test swaps in a disk that fills up)
        self.last_seq = 0
        for path in self.segments():
            self.last_seq = max(self.last_seq, self._recover(path))
        self.saved = SavedSessions(self.folder / "sessions.sqlite")
        covered = self.saved.covered()
        while covered < self.last_seq and (missing := self.read(covered, 10_000)):
            self.saved.add(missing)
            covered = missing[-1]["seq"]

    def segments(self) -> list[Path]:
        return sorted(self.folder.glob("part-*.jsonl"))

    def _bad(self, line: str) -> None:
        self.bad_lines += 1
        logger.warning("trajectories: skipped a line that is not a record: %.200s", line)

    def _recover(self, path: Path) -> int:
        """Last sequence number in a segment; a torn last line (a crash during a
        write that was never acknowledged) is cut off."""
        with open(path, "r+b") as handle:
            cut_torn_tail(handle.fileno())
        return _tail_seq(path.read_bytes())

    def append(self, records: list[TrajectoryRecord]) -> list[int]:
        """Save records (one session's export); [] if that session is saved already."""
        if not records:
            return []
        if records[0].get("session_id") is not None and self.saved.holds(records[0]["session_id"]):
            return []
        segments = self.segments()
        path = segments[-1] if segments else None
        if path is None or path.stat().st_size >= self.segment_bytes:
            path = self.folder / f"part-{self.last_seq + 1:012d}.jsonl"
        seqs = list(range(self.last_seq + 1, self.last_seq + 1 + len(records)))
        saved = [{"seq": seq, **record} for seq, record in zip(seqs, records)]
        lines = b"".join(json_line(record) for record in saved)
        with open_log(path, self.opener) as handle:
            append_whole(handle, lines, sync=True)
        self.last_seq = seqs[-1]
        self.saved.add(saved)
        return seqs

    def read(self, since: int, limit: int, max_bytes: int = READ_BYTES) -> list[dict]:
        """Records with ``seq > since``, oldest first: at most ``limit`` of them and
        ``max_bytes`` of their lines, except that a session's records (saved
        together, in one append) are never split between reads (a read returns
        at least one whole session), and an append still in progress is not read."""
        out: list[dict] = []
        size = 0
        upto = self.last_seq  # set once an append is on disk
        segments = self.segments()
        firsts = [int(p.stem.split("-")[1]) for p in segments]
        for path, following in zip(segments, firsts[1:] + [None]):
            if following is not None and following <= since + 1:
                continue  # every record in this segment is older
            with open(path, encoding="utf-8") as handle:
                for line, record in json_lines(handle, self._bad):
                    if not isinstance(record.get("seq"), int):
                        self._bad(line)
                        continue
                    if record["seq"] > upto:
                        return out
                    if record["seq"] <= since:
                        continue
                    full = len(out) >= limit or size + len(line) > max_bytes
                    if out and full and record.get("session_id") != out[-1].get("session_id"):
                        return out
                    out.append(record)
                    size += len(line)
        return out
