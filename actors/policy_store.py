"""PolicyStore: the latest published policy weights, and which replicas serve them.

Created by the first RolloutServer replica of a run (get-or-create, a named
detached actor ``rlgate-<run>-policy``). Called by the trainer (``publish``
after an optimizer step, then ``wait_served`` until every replica has the new
version) and by every RolloutServer replica (``newer_than`` long-polls for a
version it does not serve yet, ``ack`` reports what it serves). A replica
that starts, or restarts after a crash, catches up to the latest version
before it takes traffic.
Owns: the latest version, a reference to its weights in Ray's object store
(kept alive by holding it), and each replica's served version. The version
(and who serves what) is written to ``state_path`` (``<run>/policy.json``) at
each change, and Ray restarts a killed store in place, which reads it back.
The weights' reference cannot be written down: a restarted store knows the
version but not its weights (``status()["weights_lost"]``) until the trainer,
which keeps its last published reference, publishes it again
(:class:`Republisher`); meanwhile a replica that needs them waits, rather than
serve an older policy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from pathlib import Path

import ray

logger = logging.getLogger(__name__)
LOST_WEIGHTS_WAIT_S = 600.0  # how long a replica waits for the trainer to publish lost weights again


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)  # restarted in place; calls in flight fail
class PolicyStore:
    def __init__(self, initial_version: int = 0, state_path: str | None = None) -> None:
        self.state_path = Path(state_path) if state_path else None
        self.version = initial_version
        self.weights: list = []  # [ObjectRef] of the state dict: wrapped so Ray does not resolve it in transit
        self.serving: dict[str, int] = {}
        self.weights_lost = False  # a restart knows the version, not its weights, until they are published again
        self._changed = asyncio.Condition()
        restarted = ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed
        if restarted and self.state_path is not None and self.state_path.exists():
            state = json.loads(self.state_path.read_text())
            self.version, self.serving = state["version"], state["serving"]
            self.weights_lost = self.version > initial_version  # the engines start on initial_version's weights
            logger.warning("restarted at version %d; weights lost: %s", self.version, self.weights_lost)
        else:  # a state file left by a stopped run (resumed from an earlier version) is not this store's
            self._save()

    def _save(self) -> None:
        if self.state_path is None:
            return
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.state_path.with_suffix(".tmp")
        temporary.write_text(json.dumps({"version": self.version, "serving": self.serving}))
        os.replace(temporary, self.state_path)

    async def publish(self, version: int, weights: list, again: bool = False) -> None:
        """Make ``weights`` ([ObjectRef] of a full state dict) the policy at ``version``
        (newer than the published one, or the same when a restart lost its weights).

        ``again``: the published version made once more, by a trainer worker that
        restarted from an earlier checkpoint and repeated the steps to it. The
        first worker owned the weights' object, which died with it: replicas that
        had not fetched them yet take these instead."""
        async with self._changed:  # checked under the lock: two publishes waiting for it apply in turn
            if version < self.version or (version == self.version and not (self.weights_lost or again)):
                raise ValueError(f"version {version} is not newer than the published version {self.version}")
            self.version, self.weights, self.weights_lost = version, weights, False
            self._save()
            self._changed.notify_all()

    async def newer_than(self, version: int, timeout_s: float = 30.0) -> tuple[int, list] | None:
        """The latest (version, [weights ref]) once it is newer than ``version``; None on
        timeout. When a restart lost the weights of a newer version, waits for them
        (up to ``LOST_WEIGHTS_WAIT_S`` whatever ``timeout_s``) rather than let a
        replica serve an older policy; RuntimeError if they do not come."""
        async with self._changed:
            if self.version <= version and timeout_s > 0:
                try:
                    await asyncio.wait_for(self._changed.wait_for(lambda: self.version > version), timeout_s)
                except TimeoutError:
                    pass
            if self.version > version and self.weights_lost:
                try:
                    await asyncio.wait_for(self._changed.wait_for(lambda: not self.weights_lost), LOST_WEIGHTS_WAIT_S)
                except TimeoutError:
                    raise RuntimeError(
                        f"the policy store restarted and lost the weights of version {self.version}, and no "
                        f"trainer published them again within {LOST_WEIGHTS_WAIT_S:g} s"
                    ) from None
            return (self.version, self.weights) if self.version > version and self.weights else None

    async def ack(self, replica: str, version: int) -> None:
        async with self._changed:
            self.serving[replica] = version
            self._save()
            self._changed.notify_all()

    async def forget(self, replica: str) -> None:
        """A replica shut down: stop waiting for it."""
        async with self._changed:
            self.serving.pop(replica, None)
            self._save()
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
        return {"version": self.version, "serving": dict(self.serving), "weights_lost": self.weights_lost}


def get_or_create_policy_store(name: str, namespace: str, initial_version: int = 0, state_path: str | None = None):
    return PolicyStore.options(name=name, namespace=namespace, lifetime="detached", get_if_exists=True).remote(
        initial_version, state_path
    )


class Republisher:
    """The trainer's side of a PolicyStore restart: it keeps the reference to the
    weights it last published (so they outlive the store) and, from a thread,
    publishes them again whenever the store says a restart lost them."""

    def __init__(self, store, every_s: float = 2.0) -> None:
        self.store, self.every_s = store, every_s
        self.latest: tuple[int, list] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rlgate-republisher", daemon=True)
        self._thread.start()

    def published(self, version: int, weights: list) -> None:
        self.latest = (version, weights)

    def _watch(self) -> None:
        while not self._stop.wait(self.every_s):
            latest = self.latest
            try:
                if latest is not None and ray.get(self.store.status.remote())["weights_lost"]:
                    ray.get(self.store.publish.remote(*latest))
                    logger.warning("published version %d again: a policy store restart had lost it", latest[0])
            except Exception:  # the store is restarting, or moved on: look again
                logger.debug("republish check failed", exc_info=True)

    def stop(self) -> None:
        self._stop.set()


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
        self._updating: asyncio.Future | None = None  # the update under way (it finishes if _task is cancelled)

    async def _catch_up(self, timeout_s: float) -> None:
        latest = await self.store.newer_than.remote(self.engine.version, timeout_s)
        if latest is not None:
            version, [weights] = latest
            self._updating = asyncio.ensure_future(self.engine.update_weights(await weights, version))
            await asyncio.shield(self._updating)
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
            await asyncio.gather(self._task, return_exceptions=True)
        if self._updating is not None:  # an update under way finishes before the engine may go
            await asyncio.gather(self._updating, return_exceptions=True)
        await self.store.forget.remote(self.replica)
