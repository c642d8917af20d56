"""TrajectoryStore: finished trajectories, on disk before they are acknowledged.

Created by the Gateway (get-or-create, a named detached actor per run), so it
outlives any one replica. Called by SessionStore (``append`` when a session
ends), the Gateway (``read`` for ``GET /rl/trajectories``) and the training
driver (``read``, whole sessions at a time). Owns append-only JSON-lines segments under
``<run_dir>/trajectories/`` and the next sequence number; everything else is
rebuilt from the files on start, so a restarted actor loses nothing that was
acknowledged.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import ray

from rlgate.telemetry import Metrics

SEGMENT_BYTES = 64 * 2**20
RECENT_SESSIONS = 100_000


def last_seq(folder: str | Path) -> int:
    """The last sequence number written under ``folder`` (0 if none), read without
    touching the files (a store may be writing them)."""
    for segment in reversed(sorted(Path(folder).glob("part-*.jsonl"))):
        data = segment.read_bytes()
        lines = data[: data.rfind(b"\n") + 1].splitlines()  # complete lines only
        if lines:
            return json.loads(lines[-1])["seq"]
    return 0


class TrajectoryFiles:
    """The on-disk log: ``part-<first seq>.jsonl`` files, one JSON record per line,
    each with a ``seq`` (1, 2, ...). Appends are flushed and fsync'd.

    A session is saved once: an export of a session the log already holds (a
    SessionStore that crashed after saving it, before noting so, ends it again)
    is skipped. The log remembers the sessions of its last segment and of
    everything appended since it was opened (:data:`RECENT_SESSIONS` at most)."""

    def __init__(self, folder: str | Path, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = segment_bytes
        self.last_seq = 0
        for path in self.segments():
            self.last_seq = max(self.last_seq, self._recover(path))
        self.recent: dict[str, None] = {}  # session ids, oldest first
        for path in self.segments()[-1:]:
            with open(path, encoding="utf-8") as handle:
                self._remember(json.loads(line).get("session_id") for line in handle)

    def segments(self) -> list[Path]:
        return sorted(self.folder.glob("part-*.jsonl"))

    def _recover(self, path: Path) -> int:
        """Last sequence number in a segment; a torn last line (a crash during a
        write that was never acknowledged) is cut off."""
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            data = data[: data.rfind(b"\n") + 1]
            with open(path, "r+b") as handle:
                handle.truncate(len(data))
        lines = data.splitlines()
        return json.loads(lines[-1])["seq"] if lines else 0

    def _remember(self, session_ids) -> None:
        for session_id in session_ids:
            self.recent[session_id] = None
        while len(self.recent) > RECENT_SESSIONS:
            del self.recent[next(iter(self.recent))]

    def append(self, records: list[dict]) -> list[int]:
        """Save records (one session's export); [] if that session is saved already."""
        if records and records[0].get("session_id") is not None and records[0]["session_id"] in self.recent:
            return []
        segments = self.segments()
        path = segments[-1] if segments else None
        if path is None or path.stat().st_size >= self.segment_bytes:
            path = self.folder / f"part-{self.last_seq + 1:012d}.jsonl"
        seqs = list(range(self.last_seq + 1, self.last_seq + 1 + len(records)))
        lines = "".join(
            json.dumps({"seq": seq, **record}) + "\n"
            for seq, record in zip(seqs, records)  # ASCII: any str writes
        )
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(lines)
            handle.flush()
            os.fsync(handle.fileno())
        self.last_seq = seqs[-1] if seqs else self.last_seq
        self._remember(record.get("session_id") for record in records)
        return seqs

    def read(self, since: int, limit: int) -> list[dict]:
        """Records with ``seq > since``, oldest first: at most ``limit``, except that
        a session's records (saved together, in one append) are never split
        between reads, and an append still in progress is not read at all."""
        out: list[dict] = []
        upto = self.last_seq  # set once an append is on disk
        segments = self.segments()
        firsts = [int(p.stem.split("-")[1]) for p in segments]
        for path, following in zip(segments, firsts[1:] + [None]):
            if following is not None and following <= since + 1:
                continue  # every record in this segment is older
            with open(path, encoding="utf-8") as handle:
                for line in handle:
                    if not line.endswith("\n"):
                        break  # a write in progress
                    record = json.loads(line)
                    if record["seq"] > upto:
                        return out
                    if record["seq"] <= since:
                        continue
                    if len(out) >= limit and record.get("session_id") != out[-1].get("session_id"):
                        return out
                    out.append(record)
        return out


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class TrajectoryStore:
    def __init__(self, run_dir: str) -> None:
        self.files = TrajectoryFiles(Path(run_dir) / "trajectories")
        self._lock = asyncio.Lock()
        self.metrics = Metrics(Path(run_dir).name)

    async def append(self, records: list[dict]) -> list[int]:
        """Persist records (fsync'd) and return their sequence numbers."""
        async with self._lock:
            seqs = await asyncio.to_thread(self.files.append, records)
        self.metrics.inc("rlgate_trajectories_saved_total", len(seqs))
        return seqs

    async def read(self, since: int = 0, limit: int = 1000) -> list[dict]:
        return await asyncio.to_thread(self.files.read, since, limit)

    async def stats(self) -> dict:
        return {"trajectories": self.files.last_seq, "folder": str(self.files.folder)}
