"""PolicyStore: the latest published policy weights, and which replicas serve them.

Created by the first RolloutServer replica of a run (get-or-create, a named
detached actor ``rlgate-<run>-policy``). Called by the trainer (``publish``
after an optimizer step, then ``wait_served`` until every replica has the new
version) and by every RolloutServer replica (``newer_than`` long-polls for a
version it does not serve yet, ``ack`` reports what it serves). A replica
that starts, or restarts after a crash, catches up to the latest version
before it takes traffic.
Owns: the latest version, a reference to its weights in Ray's object store
(kept alive by holding it), and each replica's served version.
"""

from __future__ import annotations

import asyncio
import logging

import ray

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class PolicyStore:
    def __init__(self, initial_version: int = 0) -> None:
        self.version = initial_version
        self.weights: list = []  # [ObjectRef] of the state dict: wrapped so Ray does not resolve it in transit
        self.serving: dict[str, int] = {}
        self._changed = asyncio.Condition()

    async def publish(self, version: int, weights: list) -> None:
        """Make ``weights`` ([ObjectRef] of a full state dict) the policy at ``version``."""
        if version <= self.version:
            raise ValueError(f"version {version} is not newer than the published version {self.version}")
        async with self._changed:
            self.version, self.weights = version, weights
            self._changed.notify_all()

    async def newer_than(self, version: int, timeout_s: float = 30.0) -> tuple[int, list] | None:
        """The latest (version, [weights ref]) once it is newer than ``version``; None on timeout."""
        async with self._changed:
            if self.version <= version and timeout_s > 0:
                try:
                    await asyncio.wait_for(self._changed.wait_for(lambda: self.version > version), timeout_s)
                except TimeoutError:
                    pass
            return (self.version, self.weights) if self.version > version and self.weights else None

    async def ack(self, replica: str, version: int) -> None:
        async with self._changed:
            self.serving[replica] = version
            self._changed.notify_all()

    async def forget(self, replica: str) -> None:
        """A replica shut down: stop waiting for it."""
        async with self._changed:
            self.serving.pop(replica, None)
            self._changed.notify_all()

    async def wait_served(self, version: int, replicas: int, timeout_s: float = 300.0) -> bool:
        """True once ``replicas`` replicas serve ``version`` or newer."""

        def done() -> bool:
            return sum(v >= version for v in self.serving.values()) >= replicas

        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(done), timeout_s)
            except TimeoutError:
                return False
            return True

    async def status(self) -> dict:
        return {"version": self.version, "serving": dict(self.serving)}


def get_or_create_policy_store(name: str, namespace: str, initial_version: int = 0):
    return PolicyStore.options(name=name, namespace=namespace, lifetime="detached", get_if_exists=True).remote(
        initial_version
    )


class PolicyFollower:
    """Keeps one engine on the run's latest published policy.

    ``await follower.start()`` catches up before the replica takes traffic
    (also after a restart), then a background task long-polls the PolicyStore
    and applies each newer version in place; a failed update is logged and
    retried while the old weights keep serving.
    """

    def __init__(self, engine, store, replica: str) -> None:
        self.engine, self.store, self.replica = engine, store, replica
        self._task: asyncio.Task | None = None

    async def _catch_up(self, timeout_s: float) -> None:
        latest = await self.store.newer_than.remote(self.engine.version, timeout_s)
        if latest is not None:
            version, [weights] = latest
            await self.engine.update_weights(await weights, version)
        await self.store.ack.remote(self.replica, self.engine.version)

    async def _follow(self) -> None:
        while True:
            try:
                await self._catch_up(timeout_s=30.0)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("applying a published policy version failed; retrying")
                await asyncio.sleep(5.0)

    async def start(self) -> None:
        await self._catch_up(timeout_s=0)
        self._task = asyncio.create_task(self._follow())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.store.forget.remote(self.replica)
