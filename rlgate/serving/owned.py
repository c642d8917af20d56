"""Sessions owned by the process that serves them: state, journal, idle sweep, metrics.

:class:`OwnedSessions` is the session side of a process that holds sessions
itself: the SessionStore actor (``rlgate.actors.session_store``) and, with
``[gateway] colocate = true``, each Gateway replica. It is
:class:`LocalSessions` (a :class:`SessionManager`
behind the gateway's session interface, as tests use it) plus what a long-lived owner needs:

* a journal (``journal_path``) replayed on start: the sessions it held come
  back, their capacity slots are counted again (``reconcile``);
* ``resume``: after a crash (the owner restarted in place) those sessions go
  on; otherwise (the application itself restarted, their agents are gone)
  they are ended and exported with reason ``restart`` on the first call;
* the idle sweep and the dashboard counters, started on the first call (an
  actor's or replica's constructor may run before its event loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

from rlgate.sessions.journal import SessionJournal
from rlgate.sessions.manager import Capacity, Parent, SessionManager, sweep
from rlgate.sessions.trajectory import Interaction
from rlgate.telemetry import Metrics


class LocalSessions:
    """A :class:`SessionManager` in this process, as a :class:`SessionClient`."""

    def __init__(self, manager: SessionManager) -> None:
        self.manager = manager

    async def start(self, task_id, key_hash, refresh_key_hash, group_size, wait_s, train, follow_template) -> str:
        return await self.manager.start(task_id, key_hash, refresh_key_hash, group_size, wait_s, train, follow_template)

    async def begin(self, key_hash: str, candidate_keys: list[str]) -> tuple[str, Parent | None]:
        return self.manager.begin(key_hash, candidate_keys)

    async def record(self, session_id: str, interactions: list[Interaction]) -> None:
        self.manager.record(session_id, interactions)

    def abandon(self, session_id: str) -> None:
        self.manager.abandon(session_id)

    async def check(self, key_hash: str) -> None:
        self.manager.check(key_hash)

    async def set_reward(self, key_hash, reward, interaction_id, turn_rewards) -> str:
        return self.manager.set_reward(key_hash, reward, interaction_id, turn_rewards)

    async def end(self, key_hash: str, failed: bool) -> int:
        return await self.manager.end(key_hash, failed)

    async def stats(self) -> dict:
        return self.manager.stats()

    def open_count(self) -> int:
        return len(self.manager.sessions)


class OwnedSessions(LocalSessions):
    def __init__(
        self,
        capacity: Capacity,
        persist: Callable[[list[dict]], Awaitable[None]],
        settings: dict,
        journal_path: Path,
        *,
        resume: bool,
        reconcile: Callable[[int], object],
        flush: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """``reconcile(n)`` tells the capacity how many slots the restored sessions
        hold; ``flush()`` makes it count now what it may tell later (leased slots)."""
        super().__init__(
            SessionManager(
                capacity,
                persist,
                export_style=settings["export_style"],
                turn_discount=settings["turn_discount"],
                session_timeout_s=settings["session_timeout_s"],
                refresh_timeout_s=settings["refresh_timeout_s"],
                journal=SessionJournal(journal_path),
                max_interactions=settings["max_session_interactions"],
                max_tokens=settings["max_session_tokens"],
            )
        )
        reconcile(self.manager.restore())
        self._orphans = [] if resume else list(self.manager.sessions)
        self.manager.close_keys(self._orphans)  # their agents are gone: 410 from the first call on
        self._ending_orphans: asyncio.Task | None = None
        self._sweep_every = min(10.0, settings["session_timeout_s"] / 4)
        self._sweeper: asyncio.Task | None = None
        self.metrics = Metrics(settings["run_name"])
        self._reported, self._ended_by = dict(self.manager.counters), {}
        self._flush_capacity = flush

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

    def _ensure_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.create_task(sweep(self.manager, self._sweep_every, after=self._report))
        if self._orphans and self._ending_orphans is None:
            self._ending_orphans = asyncio.create_task(self.manager.end_sessions(self._orphans, reason="restart"))

    async def start(
        self,
        task_id,
        key_hash,
        refresh_key_hash=None,
        group_size=None,
        wait_s=0.0,
        train=True,
        follow_template=False,
    ) -> str:
        self._ensure_sweeper()
        try:
            return await super().start(task_id, key_hash, refresh_key_hash, group_size, wait_s, train, follow_template)
        finally:
            self._report()

    async def begin(self, key_hash, candidate_keys):
        self._ensure_sweeper()
        return await super().begin(key_hash, candidate_keys)

    async def record(self, session_id, interactions) -> None:
        await super().record(session_id, interactions)
        self.metrics.inc("rlgate_completion_tokens_total", sum(len(i.completion_ids) for i in interactions))

    async def check(self, key_hash: str) -> None:
        self._ensure_sweeper()
        await super().check(key_hash)

    async def set_reward(self, key_hash, reward, interaction_id, turn_rewards) -> str:
        self._ensure_sweeper()
        return await super().set_reward(key_hash, reward, interaction_id, turn_rewards)

    async def end(self, key_hash: str, failed: bool = False) -> int:
        self._ensure_sweeper()
        try:
            return await super().end(key_hash, failed)
        finally:
            self._report()

    async def expire_idle(self) -> int:
        try:
            return await self.manager.expire_idle()
        finally:
            self._report()

    async def stats(self) -> dict:
        """The counters; the capacity's then count this holder's sessions as they are."""
        self._ensure_sweeper()
        self._report()
        if self._flush_capacity is not None:
            await self._flush_capacity()
        return self.manager.stats()

    def close(self) -> None:
        for task in (self._sweeper, self._ending_orphans):
            if task is not None:
                task.cancel()


def claim_journal(folder: Path, deployment: str) -> tuple[Path, bool]:
    """The session journal in ``folder`` for a replica of ``deployment`` (a token
    made once per deployment of the application), and whether the sessions in
    it go on: only when the same deployment wrote it (a replica of it crashed
    and this one replaces it). Any other finds an earlier application's
    sessions, whose agents are gone with it."""
    folder.mkdir(parents=True, exist_ok=True)
    owner = folder / "owner"
    resume = bool(deployment) and owner.exists() and owner.read_text() == deployment
    owner.write_text(deployment)
    return folder / "journal.jsonl", resume
