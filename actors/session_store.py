"""SessionStore: live sessions, their hashed keys, interactions and rewards.

Created by the Gateway (get-or-create, a named detached actor per run) with
handles to the run's CapacityActor and TrajectoryStore. Called by every
Gateway replica: ``start``/``end`` on the session routes, ``begin``/``record``
around each completion, ``set_reward``. When a session ends (explicitly, by
refresh, or idle past the timeout) its trajectory is exported to the
TrajectoryStore, which has it on disk before the ending call returns.
Owns: the :class:`rlgate.sessions.manager.SessionManager` state, in memory and in a
journal (``<run_dir>/sessions/journal.jsonl``): Ray restarts a store that
died, in place (the Gateways' handles stay good), and the new one takes back
every open session from the journal and tells the CapacityActor how many slots
they hold. Never sees raw keys, only their SHA-256.
"""

from __future__ import annotations

from pathlib import Path

import ray

from rlgate.actors.capacity import CapacityClient
from rlgate.serving.owned import OwnedSessions
from rlgate.sessions.manager import Parent
from rlgate.sessions.trajectory import Interaction


def owned_sessions(
    capacity, trajectories, settings: dict, journal_path: Path, resume: bool, holder: str = ""
) -> OwnedSessions:
    """Sessions held in this process, journaled at ``journal_path``, admitted by
    the run's CapacityActor (counted as ``holder``'s) and exported to its TrajectoryStore."""

    async def persist(records: list[dict]) -> None:
        await trajectories.append.remote(records)

    client = CapacityClient(capacity, holder, block=settings["capacity_lease"])
    owned = OwnedSessions(
        client, persist, settings, journal_path, resume=resume, reconcile=client.reconcile, flush=client.flush
    )
    client.count = owned.manager.held_slots
    return owned


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)  # calls in flight at a crash fail (503), not replay
class SessionStore:
    def __init__(self, capacity, trajectories, settings: dict) -> None:
        # After a crash (Ray restarting this actor) the journal's sessions go on; at the first
        # start of a new application their agents are gone with the old one, so they end.
        self.owned = owned_sessions(
            capacity,
            trajectories,
            settings,
            Path(settings["run_dir"]) / "sessions" / "journal.jsonl",
            resume=ray.get_runtime_context().was_current_actor_reconstructed,
        )

    async def start(
        self,
        task_id: str,
        key_hash: str,
        refresh_key_hash: str | None = None,
        group_size: int | None = None,
        wait_s: float = 0.0,
        train: bool = True,
        follow_template: bool = False,
    ) -> str:
        return await self.owned.start(task_id, key_hash, refresh_key_hash, group_size, wait_s, train, follow_template)

    async def begin(self, key_hash: str, candidate_keys: list[str]) -> tuple[str, Parent | None]:
        return await self.owned.begin(key_hash, candidate_keys)

    async def record(self, session_id: str, interactions: list[Interaction]) -> None:
        await self.owned.record(session_id, interactions)

    async def check(self, key_hash: str) -> None:
        await self.owned.check(key_hash)

    async def abandon(self, session_id: str) -> None:
        self.owned.abandon(session_id)

    async def set_reward(
        self, key_hash: str, reward: float, interaction_id: str | None, turn_rewards: list[float] | None = None
    ) -> str:
        return await self.owned.set_reward(key_hash, reward, interaction_id, turn_rewards)

    async def end(self, key_hash: str, failed: bool = False) -> int:
        return await self.owned.end(key_hash, failed)

    async def expire_idle(self) -> int:
        return await self.owned.expire_idle()

    async def stats(self) -> dict:
        return await self.owned.stats()
