"""TrajectoryStore: finished trajectories, on disk before they are acknowledged.

Created by the Gateway (get-or-create, a named detached actor per run), so it
outlives any one replica. Called by SessionStore (``append`` when a session
ends), the Gateway (``read`` for ``GET /rl/trajectories``) and the training
driver (``read``, whole sessions at a time). Owns append-only JSON-lines segments under
``<run_dir>/trajectories/`` (:mod:`rlgate.sessions.trajectory_files`) and the next
sequence number; everything else is rebuilt from the files on start, so a
restarted actor loses nothing that was acknowledged.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import ray

from rlgate.sessions.trajectory_files import TrajectoryFiles
from rlgate.telemetry import Metrics


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
        return {
            "trajectories": self.files.last_seq,
            "folder": str(self.files.folder),
            "bad_lines": self.files.bad_lines,  # lines readers skipped: not records (see the store's log)
        }
