"""SessionStore: live sessions, their hashed keys, interactions and rewards.

Created by the Gateway (get-or-create, a named detached actor per run) with
handles to the run's CapacityActor and TrajectoryStore. Called by every
Gateway replica: ``start``/``end`` on the session routes, ``begin``/``record``
around each completion, ``set_reward``. When a session ends (explicitly, by
refresh, or idle past the timeout) its trajectory is exported to the
TrajectoryStore, which has it on disk before the ending call returns.
Owns: the :class:`rlgate.sessions.SessionManager` state, in memory and in a
journal (``<run_dir>/sessions/journal.jsonl``): Ray restarts a store that
died, in place (the Gateways' handles stay good), and the new one takes back
every open session from the journal and tells the CapacityActor how many slots
they hold. Never sees raw keys, only their SHA-256.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import ray

from rlgate.journal import SessionJournal
from rlgate.sessions import Parent, SessionManager, sweep
from rlgate.telemetry import Metrics
from rlgate.trajectory import Interaction


class _CapacityClient:
    """The CapacityActor behind the plain async interface SessionManager expects."""

    def __init__(self, actor) -> None:
        self.actor = actor

    async def acquire(self, timeout_s: float = 0.0, task_id: str | None = None, group_size: int | None = None) -> bool:
        return await self.actor.acquire.remote(timeout_s, task_id, group_size)

    async def release(self, accepted: bool) -> None:
        await self.actor.release.remote(accepted)


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)  # calls in flight at a crash fail (503), not replay
class SessionStore:
    def __init__(self, capacity, trajectories, settings: dict) -> None:
        self.trajectories = trajectories
        self.manager = SessionManager(
            _CapacityClient(capacity),
            self._persist,
            export_style=settings["export_style"],
            turn_discount=settings["turn_discount"],
            session_timeout_s=settings["session_timeout_s"],
            refresh_timeout_s=settings["refresh_timeout_s"],
            journal=SessionJournal(Path(settings["run_dir"]) / "sessions" / "journal.jsonl"),
        )
        # Sessions of an earlier incarnation hold their slots again; slots taken by calls that
        # died with it are given back. After a crash (Ray restarting this actor) they go on; at
        # the first start of a new application (the whole app restarted) their agents are gone
        # with the old one, so they are ended and exported ("restart") on the first call.
        capacity.reconcile.remote(self.manager.restore())
        reconstructed = ray.get_runtime_context().was_current_actor_reconstructed
        self._orphans = [] if reconstructed else list(self.manager.sessions)
        self._ending_orphans: asyncio.Task | None = None
        self._sweep_every = min(10.0, settings["session_timeout_s"] / 4)
        self._sweeper: asyncio.Task | None = None
        self.metrics = Metrics(settings["run_name"])
        self._reported, self._ended_by = dict(self.manager.counters), {}

    def _report(self) -> None:
        """The manager's counters since the last report, as dashboard metrics."""
        now, before = self.manager.counters, self._reported
        delta = {key: now[key] - before.get(key, 0) for key in now}
        self.metrics.inc("rlgate_sessions_started_total", delta["started"])
        self.metrics.inc("rlgate_sessions_rejected_total", delta["rejected"])
        for reason, count in self.manager.ended_by.items():
            self.metrics.inc("rlgate_sessions_ended_total", count - self._ended_by.get(reason, 0), reason=reason)
        self.metrics.set("rlgate_sessions_open", len(self.manager.sessions))
        self._reported, self._ended_by = dict(now), dict(self.manager.ended_by)

    async def _persist(self, records: list[dict]) -> None:
        await self.trajectories.append.remote(records)

    def _ensure_sweeper(self) -> None:
        # Started on the first call: an actor's __init__ runs before its event loop.
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.create_task(sweep(self.manager, self._sweep_every, after=self._report))
        if self._orphans and self._ending_orphans is None:
            self._ending_orphans = asyncio.create_task(self.manager.end_sessions(self._orphans, reason="restart"))

    async def start(
        self,
        task_id: str,
        key_hash: str,
        refresh_key_hash: str | None = None,
        group_size: int | None = None,
        wait_s: float = 0.0,
        train: bool = True,
    ) -> str:
        self._ensure_sweeper()
        try:
            return await self.manager.start(task_id, key_hash, refresh_key_hash, group_size, wait_s, train)
        finally:
            self._report()

    async def begin(self, key_hash: str, candidate_keys: list[str]) -> tuple[str, Parent | None]:
        self._ensure_sweeper()
        return self.manager.begin(key_hash, candidate_keys)

    async def record(self, session_id: str, interactions: list[Interaction]) -> None:
        self.manager.record(session_id, interactions)
        self.metrics.inc("rlgate_completion_tokens_total", sum(len(i.completion_ids) for i in interactions))

    async def check(self, key_hash: str) -> None:
        self.manager.check(key_hash)

    async def abandon(self, session_id: str) -> None:
        self.manager.abandon(session_id)

    async def set_reward(
        self, key_hash: str, reward: float, interaction_id: str | None, turn_rewards: list[float] | None = None
    ) -> str:
        return self.manager.set_reward(key_hash, reward, interaction_id, turn_rewards)

    async def end(self, key_hash: str, failed: bool = False) -> int:
        try:
            return await self.manager.end(key_hash, failed)
        finally:
            self._report()

    async def expire_idle(self) -> int:
        try:
            return await self.manager.expire_idle()
        finally:
            self._report()

    async def stats(self) -> dict:
        self._ensure_sweeper()
        self._report()
        return self.manager.stats()
