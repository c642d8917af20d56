"""CapacityActor: the policy version and staleness-bounded session admission.

Created by ``serve_app`` (or ``train_driver``) as one named detached actor
through :func:`get_or_create_capacity`, so it outlives the driver that made it
and every part finds the same one by name.
Called by whoever holds sessions, the SessionStore or each colocated Gateway
replica (``acquire`` when a session opens, ``release`` when it ends, each
under its ``holder`` name, so a holder that restarts recounts only its own),
and by the trainer (``grant`` when it attaches, ``on_new_version`` after
publishing weights, ``discard`` for sessions it dropped untrained, ``detach``
when it leaves).
Owns: the :class:`rlgate.capacity.CapacityRule`, the ``running`` (per holder), ``accepted``
and ``rejected`` counters and the policy ``version``. The state lives in memory
only: a restarted actor would not know which sessions are open.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, replace

import ray

from rlgate.capacity import CapacityRule, CapacityStats, GroupReservations, free_slots
from rlgate.telemetry import Metrics


# num_cpus=0: pure bookkeeping; it must never wait for a CPU on a packed cluster.
@ray.remote(num_cpus=0)
class CapacityActor:
    def __init__(self, max_concurrent: int) -> None:
        self.rule = CapacityRule(max_concurrent=max_concurrent)
        self.held: dict[str, int] = {}  # holder -> its open sessions
        self.accepted = 0
        self.rejected = 0
        self.version = 0
        # What a trainer's staleness rule counts from: sessions accepted and
        # versions published before it attached are not its business.
        self.accepted_base = 0
        self.version_base = 0
        # Accepted sessions the trainer threw away (equal rewards, partial or stale
        # groups): they fill no batch, so they must not use up the staleness budget.
        self.discarded = 0
        self.reservations = GroupReservations()  # slots held for groups already started
        # Bumped by a holder's reconcile: an acquire that waited across that holder's restart
        # was made by the holder that died, and must not take a slot no one will release.
        self.generations: dict[str, int] = {}
        # Notified on every change that can free a slot (release, new version, new settings).
        self._changed = asyncio.Condition()
        name = (ray.get_runtime_context().get_actor_name() if ray.is_initialized() else None) or "rlgate-capacity"
        self.metrics = Metrics(name.removeprefix("rlgate-").removesuffix("-capacity"))

    @property
    def running(self) -> int:
        return sum(self.held.values())

    def _report(self) -> None:
        self.metrics.set("rlgate_policy_version", self.version)
        self.metrics.set("rlgate_capacity_running", self.running)
        self.metrics.set("rlgate_capacity_free", self._free())

    def _free(self) -> int:
        counted = self.accepted - self.accepted_base - self.discarded
        reserved = self.reservations.held() if self.rule.batch_size is not None else 0
        return free_slots(self.rule, self.running, max(counted, 0), self.version - self.version_base, reserved)

    def _admits(self, task_id: str | None, group_size: int | None) -> bool:
        self.reservations.expire(time.monotonic(), self.rule.group_timeout_s)
        if self.rule.batch_size is None or task_id is None:
            return self._free() > 0
        if self.reservations.joins(task_id):  # its slot is held: only max_concurrent applies
            return self.running < self.rule.max_concurrent
        return self._free() >= self.reservations.needed(task_id, self.rule.group_slots(group_size))

    async def acquire(
        self, timeout_s: float = 0.0, task_id: str | None = None, group_size: int | None = None, holder: str = ""
    ) -> bool:
        """Take one slot, waiting up to ``timeout_s`` for one; False (a rejection) on timeout.

        With a trainer attached and a ``task_id``, the first session of a group
        needs room for the whole group (``group_size``, default the trainer's)
        and reserves it; the group's other sessions take the reserved slots.
        """
        if timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0 (got {timeout_s})")
        deadline, generation = time.monotonic() + timeout_s, self.generations.get(holder, 0)
        async with self._changed:
            # Reservations lapse with time, not with an event: look again at least every second.
            while not self._admits(task_id, group_size) and (left := deadline - time.monotonic()) > 0:
                try:
                    await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
                except TimeoutError:  # the builtin TimeoutError only from Python 3.11
                    pass
            if generation != self.generations.get(holder, 0):
                return False  # its caller is gone
            if not self._admits(task_id, group_size):
                self.rejected += 1
                self._report()
                return False
            if self.rule.batch_size is None and task_id is not None:
                self.reservations.started_early(task_id)
            elif task_id is not None:
                if self.reservations.joins(task_id):
                    self.reservations.join(task_id)
                else:
                    self.reservations.open(task_id, self.rule.group_slots(group_size), time.monotonic())
            self.held[holder] = self.held.get(holder, 0) + 1
            self._report()
            return True

    async def release(self, accepted: bool, holder: str = "") -> None:
        """A session of ``holder`` ended; ``accepted`` when its trajectory was finished and exported."""
        async with self._changed:
            if not self.held.get(holder):
                raise ValueError(f"release without a running session of holder {holder!r} (it holds none)")
            self.held[holder] -= 1
            self.accepted += int(accepted)
            self._changed.notify_all()
            self._report()

    async def reconcile(self, running: int, holder: str = "") -> None:
        """``holder`` (re)started holding ``running`` open sessions: that is its count."""
        async with self._changed:
            self.held[holder], self.generations[holder] = running, self.generations.get(holder, 0) + 1
            self._changed.notify_all()
            self._report()

    async def grant(
        self, batch_size: int, max_staleness: int, group_size: int = 1, group_timeout_s: float = 600.0
    ) -> None:
        """A trainer attaches (or changes its settings): admit whole groups by the
        staleness rule, counting accepted sessions and versions from now."""
        if self.rule.batch_size is None:
            self.accepted_base, self.version_base, self.discarded = self.accepted, self.version, 0
            self.reservations = GroupReservations(early=self.reservations.early)
        await self._set_rule(
            batch_size=batch_size,
            max_staleness=max_staleness,
            group_size=group_size,
            group_timeout_s=group_timeout_s,
        )

    async def discard(self, sessions: int) -> None:
        """The trainer dropped ``sessions`` accepted sessions without training on
        them; as many new ones may start in their place."""
        if sessions < 0:
            raise ValueError(f"sessions must be >= 0 (got {sessions})")
        async with self._changed:
            self.discarded += sessions
            self._changed.notify_all()
            self._report()

    async def detach(self) -> None:
        """The trainer left: admit by ``max_concurrent`` only."""
        await self._set_rule(batch_size=None, max_staleness=0)

    async def set_max_concurrent(self, n: int) -> None:
        await self._set_rule(max_concurrent=n)

    async def on_new_version(self, version: int) -> None:
        """The trainer published weights of ``version``; versions never go backwards."""
        async with self._changed:
            if version < self.version:
                raise ValueError(f"policy version cannot go backwards: {self.version} -> {version}")
            self.version = version
            self._changed.notify_all()
            self._report()

    async def stats(self) -> dict:
        rule = self.rule
        return asdict(
            CapacityStats(
                running=self.running,
                accepted=self.accepted,
                discarded=self.discarded,
                rejected=self.rejected,
                version=self.version,
                max_concurrent=rule.max_concurrent,
                batch_size=rule.batch_size,
                max_staleness=rule.max_staleness,
                group_size=rule.group_size,
                reserved=self.reservations.held() if rule.batch_size is not None else 0,
                free=self._free(),
            )
        )

    async def _set_rule(self, **changes) -> None:
        async with self._changed:
            self.rule = replace(self.rule, **changes)  # validated by CapacityRule
            self._changed.notify_all()
            self._report()


def get_or_create_capacity(name: str, namespace: str | None, max_concurrent: int):
    """The named detached CapacityActor, created with ``max_concurrent`` if it does not exist.

    An existing actor keeps its settings and counters; call ``set_max_concurrent``
    to change them.
    """
    return CapacityActor.options(name=name, namespace=namespace, lifetime="detached", get_if_exists=True).remote(
        max_concurrent
    )
